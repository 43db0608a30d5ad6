"""Hostile request entries, each with the id its error event must carry (None: unreadable)."""

from __future__ import annotations

import random
import uuid

import msgspec

HUGE_PROMPT_BYTES = 10_000_000
NESTING_DEPTH = 20_000


def _pack(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def hostile_entry(index: int, rng: random.Random) -> tuple[dict[str, bytes], str | None]:
    """The ``index``-th hostile entry: (stream entry fields, readable request id or None)."""
    rid = f"hostile-{index}-{uuid.uuid4().hex[:8]}"
    head = b"\x83" + _pack("v") + _pack(1) + _pack("id") + _pack(rid)
    kinds: list[tuple[dict[str, bytes], str | None]] = [
        ({"msg": rng.randbytes(rng.randint(1, 512))}, None),  # random bytes
        ({"junk": rng.randbytes(16)}, None),  # no payload field
        ({"msg": _pack({"v": 1, "id": rid, "prompt": 5, "max_tokens": "many"})}, rid),
        ({"msg": _pack({"v": 1, "id": rid, "prompt": "w5 w6", "max_tokens": 2**62})}, rid),
        ({"msg": _pack({"v": 1, "id": "x" * 10_000, "prompt": "w5"})}, None),  # 10,000-char id
        ({"msg": head + _pack("messages") + b"\x91" * NESTING_DEPTH + _pack("x")}, rid),
        ({"msg": head + _pack("prompt") + b"\xa3\xff\xfe\xfd"}, rid),  # invalid UTF-8
        ({"msg": _pack([rid, "w5"])}, None),  # not a map
    ]
    if index % 100 == 99:  # a 10 MB prompt, twice in 200 (each costs Redis 10 MB of AOF)
        return {"msg": _pack({"v": 1, "id": rid, "prompt": "w5 " * (HUGE_PROMPT_BYTES // 3)})}, rid
    return kinds[index % len(kinds)]


def invalid_reuse(request_id: str) -> dict[str, bytes]:
    """An entry that decodes but is invalid (``max_tokens`` -5), reusing ``request_id``: it must
    be dead-lettered without an event in that id's stream (which belongs to its owner)."""
    return {"msg": _pack({"v": 1, "id": request_id, "prompt": "w5 w6", "max_tokens": -5})}
