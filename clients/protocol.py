"""The wire protocol between clients and workers: Redis keys, TTLs and msgpack payloads.

Every payload is a ``msgspec.Struct`` encoded with msgpack into the single field
``PAYLOAD_FIELD`` of a stream entry (or the value of a plain key), and carries ``v``, the schema
version. Requests go to ``{p}:requests`` (consumer group ``{p}:workers``); the events of one
request come back, in order, on ``{p}:out:{request_id}``: ``token`` ... then exactly one of
``done`` or ``error``; a ``restart`` event says that a new attempt begins after a worker died.
See ``docs/protocol.md``.

This module imports msgspec only: workers and clients both use it, and clients never load torch.
"""

from __future__ import annotations

import binascii
import enum
import functools
import itertools
import json
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec

from clients.msgpack_peek import peek_str_field

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "pagestream"
PAYLOAD_FIELD = "msg"  # the one field of every stream entry written by pagestream

OUT_STREAM_TTL_S = 3600  # {p}:out:{id} expires this long after its last event
CANCEL_TTL_S = 3600  # {p}:cancel:{id} is remembered this long
CLAIM_TTL_S = 24 * 3600  # {p}:claim:{id}: a duplicate id is refused for this long
HEARTBEAT_TTL_S = 15  # {p}:worker:{name} vanishes this long after the worker's last beat
CANCELS_MAXLEN = 10_000  # {p}:cancels keeps about this many recent notices
DEAD_MAXLEN = 100_000  # {p}:dead keeps about this many entries
MAX_REQUEST_ID_CHARS = 256
MAX_SHARDS = 256  # request streams of one deployment, at most
# The layout of a request's out stream and claim (docs/protocol.md#key-layout):
# 1 = its id as hash tag, ``{p}:out:{id}`` (one shard, as ever); 2 = with K > 1 shards its
# shard's tag, ``{p}:out:{s1-4}:id``, so that one script writes a whole shard's events.
KEY_LAYOUT_PER_REQUEST = 1
KEY_LAYOUT_PER_SHARD = 2
CLUSTER_SLOTS = 16384  # Redis Cluster's hash slots
# msgpack's integers: what any integer field of a payload can hold
MIN_INT, MAX_INT = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class Keys:
    """Builds every Redis key of one deployment (all share ``prefix``).

    ``num_shards`` request streams take the requests (one: ``{p}:requests``, as ever); clients
    and workers of a deployment must agree on it."""

    prefix: str = DEFAULT_PREFIX
    num_shards: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_shards <= MAX_SHARDS:
            raise ValueError(f"the number of shards must be 1..{MAX_SHARDS}, got {self.num_shards}")

    @property
    def requests(self) -> str:
        """The request stream of a deployment with one shard (shard 0's key)."""
        return f"{self.prefix}:requests"

    @property
    def shards(self) -> list[str]:
        """Every request stream (shard) of the deployment, in shard order."""
        return [self.shard(index) for index in range(self.num_shards)]

    def shard(self, index: int) -> str:
        """Request stream ``index`` (0-based). With more than one shard each key holds a hash
        tag of its own (``{p}:requests:{s1-4}``) chosen so that shard i of K lies in the i-th
        K-th of Redis Cluster's slots: on a cluster whose primaries hold equal slot ranges in
        order (what ``redis-cli --cluster create`` does), K = the number of primaries puts one
        shard on each."""
        if self.num_shards == 1:
            return self.requests
        return f"{self.prefix}:requests:{{{shard_tag(index, self.num_shards)}}}"

    def shard_for(self, request_id: str, session: str | None = None) -> str:
        """The shard a request goes to: by its ``session`` when it has one (a conversation's
        turns share a shard), else by its id."""
        if self.num_shards == 1:
            return self.requests
        placed_by = request_id if session is None else session
        return self.shard(zlib.crc32(placed_by.encode()) % self.num_shards)

    @property
    def group(self) -> str:
        """The consumer group of the workers on ``requests``."""
        return f"{self.prefix}:workers"

    @property
    def cancels(self) -> str:
        """The stream of cancel notices that every worker tails."""
        return f"{self.prefix}:cancels"

    @property
    def dead(self) -> str:
        """Entries that could not be served (malformed, or delivered too often)."""
        return f"{self.prefix}:dead"

    # A request's out stream and claim share one hash slot, so one script may touch them
    # together. With one shard their hash tag is the id (``{p}:out:{id}``: every request a
    # slot of its own); with K > 1 it is the tag of the request's key shard
    # (``{p}:out:{s1-4}:id``): all the requests of a shard share a slot, and a worker writes a
    # step's events for all of them in one script call, a client reads all of them with one
    # XREAD. The cancel key keeps the id as its tag whatever K: no script touches it with the
    # others, and whoever cancels by id needs nothing else.

    @property
    def key_layout(self) -> int:
        """``KEY_LAYOUT_PER_REQUEST`` with one shard, else ``KEY_LAYOUT_PER_SHARD``."""
        return KEY_LAYOUT_PER_REQUEST if self.num_shards == 1 else KEY_LAYOUT_PER_SHARD

    def key_shard(self, request_id: str) -> int:
        """The shard whose hash tag a request's out stream and claim carry: ``crc32(id) mod
        K``, by the id alone (not the session), so that whoever knows the id and K finds them
        (the worker running it, a caller resuming a request it did not submit)."""
        return zlib.crc32(request_id.encode()) % self.num_shards

    def new_request_id(self, home_shard: int | None = None, *, label: str = "") -> str:
        """A fresh request id (``label`` and 32 hex digits); with ``home_shard``, one whose out
        stream and claim carry that shard's tag (``key_shard``) and whose entry, without a
        session, goes to that shard's request stream: a request's every key then lives on
        the shard's primary. Ids are drawn until one fits (K draws on average)."""
        if home_shard is not None and (error := self.home_shard_error(home_shard)):
            raise ValueError(error)
        while True:
            request_id = f"{label}{uuid.uuid4().hex}"
            if home_shard is None or self.key_shard(request_id) == home_shard:
                return request_id

    def home_shard_error(self, home_shard: int, name: str = "home shard") -> str | None:
        """Why ``home_shard`` (called ``name`` in the message) is not one of the shards, or
        None: the one check of the client, the gateway's settings and ``new_request_id``."""
        if 0 <= home_shard < self.num_shards:
            return None
        return (f"{name} must be 0..{self.num_shards - 1} with {self.num_shards} shards, "
                f"got {home_shard}")  # fmt: skip

    def _request_key(self, kind: str, request_id: str) -> str:
        if self.num_shards == 1:
            return f"{self.prefix}:{kind}:{{{request_id}}}"
        tag = shard_tag(self.key_shard(request_id), self.num_shards)
        return f"{self.prefix}:{kind}:{{{tag}}}:{request_id}"

    def out(self, request_id: str) -> str:
        """The event stream of one request."""
        return self._request_key("out", request_id)

    def client_wake(self, client_id: str, tag: str | None = None) -> str:
        """A client's own stream, appended to end its blocked read of the out streams; with
        ``tag`` (a hash tag) one in that tag's slot, for a read of that slot's streams."""
        if tag is None:
            return f"{self.prefix}:client:{client_id}:wake"
        return f"{self.prefix}:client:{{{tag}}}:{client_id}:wake"

    def cancel(self, request_id: str) -> str:
        """Set when a request is cancelled; checked when a worker admits the request. Named by
        the id alone, whatever the shards: a caller cancelling by id needs no K."""
        return f"{self.prefix}:cancel:{{{request_id}}}"

    def lettered(self, stream: str, entry_id: str) -> str:
        """Marks a request entry dead-lettered (Redis Cluster only): one letter per entry. Its
        hash tag is the dead stream's name, so it shares the dead stream's slot."""
        return f"{self.prefix}:lettered:{{{self.dead}}}:{stream}:{entry_id}"

    def claim(self, request_id: str) -> str:
        """Which stream entry owns a request id (so a duplicate id is not run twice)."""
        return self._request_key("claim", request_id)

    def restarts(self, request_id: str) -> str:
        """A request's restarts (a hash: ``n``, how many; ``reason``, why the next one will
        happen when a worker said so), numbering its ``restart`` events."""
        return self._request_key("restarts", request_id)

    def worker(self, name: str) -> str:
        """A worker's heartbeat (a ``WorkerStatus``, with a TTL)."""
        return f"{self.prefix}:worker:{name}"

    def worker_pattern(self) -> str:
        """``SCAN`` pattern matching every worker's heartbeat key."""
        return f"{self.prefix}:worker:*"

    # Prefix-aware routing (docs/routing.md): a worker's own stream, read by the same group.

    def routed(self, name: str) -> str:
        """The request stream of one worker (entries routed to it; others may steal them)."""
        return f"{self.prefix}:requests:{name}"

    @property
    def routed_workers(self) -> str:
        """The set of workers that have a routed stream (takeover and stealing scan it)."""
        return f"{self.prefix}:routed"

    def prefix_link(self, link_hex: str) -> str:
        """The worker that last served a request holding this prefix link (with a TTL)."""
        return f"{self.prefix}:px:{link_hex}"

    def session(self, session_id: str) -> str:
        """The worker that last served this session (with a TTL)."""
        return f"{self.prefix}:session:{{{session_id}}}"


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: the text in its first ``{...}`` when that is not
    empty, else the whole key. Keys with the same hash tag share a slot."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def key_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key``: CRC16 (XMODEM) of its hash tag, mod 16384."""
    return binascii.crc_hqx(hash_tag(key).encode(), 0) % CLUSTER_SLOTS


@functools.lru_cache(maxsize=MAX_SHARDS)
def shard_tag(index: int, num_shards: int) -> str:
    """The hash tag of shard ``index`` of ``num_shards``: the first ``s{index}-{n}`` whose slot
    lies in the ``index``-th of ``num_shards`` equal slot ranges."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index must be 0..{num_shards - 1}, got {index}")
    low = index * CLUSTER_SLOTS // num_shards
    high = (index + 1) * CLUSTER_SLOTS // num_shards
    for n in itertools.count():
        tag = f"s{index}-{n}"
        if low <= key_slot(f"{{{tag}}}") < high:
            return tag
    raise AssertionError("unreachable")


# -- requests ----------------------------------------------------------------------------------


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One chat message. An assistant message may carry the ``tool_calls`` it made (OpenAI's
    shape, ``function.arguments`` as an object or its JSON text) and the
    ``reasoning_content`` it thought, a ``tool`` message the ``tool_call_id`` it answers, any
    message a ``name`` (added in v1 with defaults: old clients never send them). The chat
    template gets every field that is set."""

    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The shape the output must take: exactly one field set (see the engine's
    ``StructuredOutputs`` and docs/structured-outputs.md). ``json_schema`` is the schema's
    JSON text; ``grammar`` is in llguidance's Lark syntax."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A generation request: exactly one of ``prompt``, ``messages``, ``token_ids``.

    ``deadline_ms`` and ``enqueued_at_ms`` are wall-clock Unix times in milliseconds; the
    sampling fields mean what they mean in the engine's ``SamplingParams``: a prompt +
    ``max_tokens`` past the model's context is refused unless ``clamp_max_tokens`` asks to
    lower ``max_tokens`` to fit; no ``max_tokens``: 16, lowered to fit without asking.
    """

    v: int = PROTOCOL_VERSION
    id: str
    prompt: str | None = None
    messages: list[Message] | None = None
    token_ids: list[int] | None = None
    # sampling
    max_tokens: int | None = None
    clamp_max_tokens: bool = False
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # constrained decoding (added in v1 with a default: old clients never send it)
    structured_outputs: StructuredOutputs | None = None
    # samples and chat templating (added in v1 with defaults: old clients never send them)
    n: int = 1
    best_of: int | None = None
    tools: list[dict[str, Any]] | None = None  # given to the chat template (messages only)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # scheduling and tracing
    priority: int = 0
    tenant: str = "default"
    deadline_ms: int | None = None
    traceparent: str | None = None
    enqueued_at_ms: int | None = None
    # routing (added in v1 with a default): pins a conversation to the worker that served it
    session: str | None = None


SAMPLING_FIELDS = (
    "max_tokens", "clamp_max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "n", "best_of",
)  # fmt: skip


class CancelNotice(msgspec.Struct, kw_only=True):
    """An entry of ``{p}:cancels``: stop ``id`` wherever it runs."""

    v: int = PROTOCOL_VERSION
    id: str


# -- events --------------------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"


class ErrorCode(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"  # a field is missing, mistyped, unknown or out of range
    MALFORMED = "malformed"  # the entry could not be decoded at all
    TOO_MANY_DELIVERIES = "too_many_deliveries"  # workers died on it max_deliveries times
    INTERNAL = "internal_error"  # the engine failed; the request went to the dead stream


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


class Timings(msgspec.Struct, kw_only=True):
    """Where a request's time went, in milliseconds (``None`` where not measured)."""

    queue_ms: float | None = None  # enqueued -> admitted (wall clocks of client and worker)
    time_to_first_token_ms: float | None = None  # admitted -> first token
    total_ms: float = 0.0  # admitted -> finished


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    v: int = PROTOCOL_VERSION
    # The stream entry id the event was read from: set by the client (empty on the wire).
    event_id: str = ""


class TokenEvent(_Event, tag="token"):
    """New tokens: ``seq`` counts token events from 0 within one attempt.

    A request with ``n`` > 1 (or ``best_of``) streams each sample's tokens under its
    ``index`` (0..n-1); the last event of each sample carries its ``finish_reason`` (and
    ``stop_reason``), with no tokens when it ended without new ones. (Added in v1 with
    defaults: index 0 and no finish_reason for a request of one sample.)
    """

    seq: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    index: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class DoneEvent(_Event, tag="done"):
    """The request ended normally (terminal). With ``n`` > 1 ``finish_reason`` is that of
    the sample that ended last (each sample's own came on its last ``token`` event) and
    ``usage`` covers every sample, the prompt counted once."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings = msgspec.field(default_factory=Timings)
    stop_reason: str | int | None = None
    worker: str = ""


class ErrorEvent(_Event, tag="error"):
    """The request failed (terminal); ``field`` names the offending request field, if any."""

    code: ErrorCode
    message: str
    field: str | None = None


class RestartEvent(_Event, tag="restart"):
    """A new attempt begins: forget the tokens of earlier attempts."""

    attempt: int  # 1 for the first retry
    worker: str
    reason: str = "lease expired"  # or "handed back" (its worker stopped and gave it back)


Event = TokenEvent | DoneEvent | ErrorEvent | RestartEvent
TERMINAL_EVENTS = (DoneEvent, ErrorEvent)


# -- operators' records ----------------------------------------------------------------------------


class DeadLetter(msgspec.Struct, kw_only=True):
    """An entry of ``{p}:dead``: a request entry no worker will serve, and why."""

    v: int = PROTOCOL_VERSION
    entry_id: str
    request_id: str | None = None
    code: ErrorCode
    message: str
    worker: str
    times_delivered: int = 1
    payload: bytes | None = None  # the entry's payload field, as it was


class WorkerStatus(msgspec.Struct, kw_only=True):
    """A worker's heartbeat, the value of ``{p}:worker:{name}``."""

    v: int = PROTOCOL_VERSION
    name: str
    host: str
    pid: int
    model: str
    started_at_ms: int
    updated_at_ms: int
    num_in_flight: int
    max_in_flight: int
    num_running: int = 0
    num_waiting: int = 0
    num_pages_free: int = 0
    num_steps: int = 0  # engine steps since the worker started
    step_time_s: float = 0.0  # time spent in those steps, summed
    loop_lag_max_ms: float = 0.0  # its event loop's worst lateness since the last heartbeat
    # The output formats its model's chat template teaches ("" = none found): the gateway's
    # --tool-call-parser / --reasoning-parser auto take these
    tool_call_parser: str = ""
    reasoning_parser: str = ""


# -- encoding --------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event)
_request_decoder = msgspec.msgpack.Decoder(Request)


def encode(value: msgspec.Struct) -> bytes:
    """Any protocol struct as msgpack bytes."""
    return _encoder.encode(value)


def new_request(
    request_id: str,
    *,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    token_ids: list[int] | None = None,
    priority: int = 0,
    tenant: str = "default",
    timeout_s: float | None = None,
    traceparent: str | None = None,
    now_ms: int,
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None,
    json_schema: dict[str, Any] | str | None = None,
    **sampling: Any,
) -> Request:
    """The ``Request`` a client submits at ``now_ms`` (wall clock): ``timeout_s`` becomes its
    deadline, ``messages`` its ``Message``s, ``sampling`` its sampling fields.

    ``structured_outputs`` (a struct or a dict of its fields) constrains the output;
    ``json_schema`` (a schema as a dict, or its JSON text) is short for
    ``structured_outputs={"json_schema": ...}``."""
    if json_schema is not None:
        if structured_outputs is not None:
            raise ValueError("give structured_outputs or json_schema, not both")
        structured_outputs = {"json_schema": json_schema}
    return Request(
        id=request_id,
        prompt=prompt,
        messages=None if messages is None else [Message(**m) for m in messages],
        token_ids=token_ids,
        priority=priority,
        tenant=tenant,
        deadline_ms=None if timeout_s is None else now_ms + int(timeout_s * 1000),
        traceparent=traceparent,
        enqueued_at_ms=now_ms,
        structured_outputs=structured_outputs_of(structured_outputs),
        **sampling,
    )


def structured_outputs_of(
    value: StructuredOutputs | dict[str, Any] | None,
) -> StructuredOutputs | None:
    """``value`` as a ``StructuredOutputs``; a dict's ``json_schema`` may be the schema itself
    (a dict), sent as its JSON text. Raises ``ValueError`` for fields it does not have."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value.get("json_schema"), dict):
        value = {**value, "json_schema": json.dumps(value["json_schema"])}
    try:
        return msgspec.convert(value, StructuredOutputs)
    except msgspec.ValidationError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None


def encode_request(request: Request) -> bytes:
    """``request`` as msgpack bytes; raises ``ValueError`` naming a field whose integer does
    not fit msgpack's 64 bits (the encoder's own error names none)."""
    try:
        return _encoder.encode(request)
    except OverflowError:
        for name in request.__struct_fields__:
            value = getattr(request, name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, int) and not MIN_INT <= v <= MAX_INT for v in values):
                raise ValueError(f"{name}: integers must fit 64 bits, in [-2**63, 2**64)") from None
        raise


def decode_event(data: bytes, event_id: str = "") -> Event:
    """An out-stream payload; raises ``msgspec.DecodeError`` when it is not an event."""
    event = _event_decoder.decode(data)
    event.event_id = event_id
    return event


def decode_request(data: bytes) -> Request:
    """A request payload; raises ``msgspec.DecodeError`` (``ValidationError``) naming the field."""
    return _request_decoder.decode(data)


class _IdOnly(msgspec.Struct):
    """A payload's ``id`` alone: decoding skips every other field without building it."""

    id: Any = None


def peek_request_id(data: bytes) -> str | None:
    """The ``id`` of a payload that may not be a valid request (or too large to decode as
    one), when one can be read."""
    try:
        request_id = msgspec.msgpack.decode(data, type=_IdOnly).id
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        # msgspec refuses the whole payload (invalid UTF-8 or nesting too deep elsewhere):
        # the id may still be readable on its own.
        request_id = peek_str_field(data, "id")
    return request_id if is_valid_request_id(request_id) else None


def is_valid_request_id(value: object) -> bool:
    """Ids are non-empty printable strings of at most ``MAX_REQUEST_ID_CHARS`` characters."""
    return isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isprintable()


def check_request_id(value: object) -> None:
    """``ValueError`` for an id no request can have (a worker could not answer on a stream it
    names)."""
    if not is_valid_request_id(value):
        shown = repr(value) if len(repr(value)) <= 80 else f"{len(str(value))} characters"
        raise ValueError(
            f"not a request id: request_id must be 1..{MAX_REQUEST_ID_CHARS} printable "
            f"characters, got {shown}"
        )


def decode_struct(data: bytes, struct_type: type[msgspec.Struct]) -> Any:
    """Decode a payload as ``struct_type`` (heartbeats, cancel notices, dead letters)."""
    return msgspec.msgpack.decode(data, type=struct_type)
