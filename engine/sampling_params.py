"""Per-request sampling settings, validated when they are made."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError, describe, wrong_type
from engine.structured.params import StructuredOutputs

MAX_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # when a request sets none (fewer where the context ends first)


GREEDY_BELOW = 1e-5  # a temperature under this samples as 0 does: the argmax


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy, and so does any temperature below ``GREEDY_BELOW``
    (as in vLLM): dividing logits by less overflows float32, and a row of infinities has no
    distribution to sample. Penalties follow the usual definitions:
    ``repetition_penalty`` divides positive logits (multiplies negative ones) of every token
    seen in the prompt or output; ``presence_penalty`` subtracts a constant from every token
    seen in the output; ``frequency_penalty`` subtracts once per occurrence in the output.

    A request whose prompt + ``max_tokens`` exceeds the model's context is refused, unless
    ``clamp_max_tokens`` (or the engine's ``clamp_max_tokens``) lowers ``max_tokens`` to fit.
    ``max_tokens=None``: ``DEFAULT_MAX_TOKENS``, lowered to fit without asking.

    ``n`` samples of the prompt come back (its pages computed once and shared); with
    ``best_of`` > ``n``, ``best_of`` are generated and the ``n`` of highest cumulative
    logprob come back, once all have ended. Sample ``i`` of a seeded request uses
    ``seed + i``.

    ``structured``: the output must match a JSON schema, regex, grammar or choice list
    (docs/structured-outputs.md).
    """

    max_tokens: int | None = None
    clamp_max_tokens: bool = False
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k filter
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None  # None = n
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a bare string for stop; store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self._check_types()
        for name in ("stop", "stop_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _check_types(self) -> None:
        """Types before ranges: ``"hot"`` is not a number, rather than a number below 0."""
        for field in dataclasses.fields(self):  # in order: the first wrong field is named
            value = getattr(self, field.name)
            if field.name in LIST_TYPES:
                _check_list(field.name, value, *LIST_TYPES[field.name])
            elif not FIELD_TYPES[field.name][0](value):
                raise wrong_type(field.name, FIELD_TYPES[field.name][1], value)

    def _validate(self) -> None:
        """Ranges (the types are right by now; NaN fails every comparison)."""
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.n >= 1, "n", "must be >= 1")
        _check(self.best_of is None or self.best_of >= self.n, "best_of", "must be >= n")
        _check(
            self.min_tokens <= (self.max_tokens or DEFAULT_MAX_TOKENS),
            "min_tokens",
            f"must not exceed max_tokens ({DEFAULT_MAX_TOKENS} when not set)",
        )
        _check(0 <= self.temperature < math.inf, "temperature", "must be finite and >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "must be >= 1, or 0/-1 for off")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            "must be finite and > 0 (1 = off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]")
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**64,
            "seed",
            "must be an integer of 64 bits, in [-2**63, 2**64)",
        )
        _check(
            self.structured is None or self.min_tokens == 0,
            "min_tokens",
            "cannot be combined with structured outputs (the grammar decides where the "
            "output ends)",
        )
        _check(all(self.stop), "stop", "must be non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """These settings with ``max_tokens`` (and ``min_tokens`` no higher)."""
        if max_tokens == self.max_tokens:
            return self
        min_tokens = min(self.min_tokens, max_tokens)
        return dataclasses.replace(self, max_tokens=max_tokens, min_tokens=min_tokens)

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: ``best_of``, or ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole story (once ``min_tokens`` is reached)."""
        return self.is_greedy and not self.has_penalties and self.logprobs is None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_int_or_none(value: object) -> bool:
    return value is None or _is_int(value)


def _is_structured_or_none(value: object) -> bool:
    return value is None or isinstance(value, StructuredOutputs)


_INTEGER = (_is_int, "an integer")
_NUMBER = (_is_number, "a number")
_BOOLEAN = (_is_bool, "true or false")
_INTEGER_OR_NULL = (_is_int_or_none, "an integer or null")
# The type of every field: (test, words for the error)
FIELD_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "max_tokens": _INTEGER_OR_NULL,
    "clamp_max_tokens": _BOOLEAN,
    "min_tokens": _INTEGER,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INTEGER,
    "min_p": _NUMBER,
    "repetition_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "seed": _INTEGER_OR_NULL,
    "ignore_eos": _BOOLEAN,
    "logprobs": _INTEGER_OR_NULL,
    "include_stop_str_in_output": _BOOLEAN,
    "skip_special_tokens": _BOOLEAN,
    "n": _INTEGER,
    "best_of": _INTEGER_OR_NULL,
    "structured": (_is_structured_or_none, "a StructuredOutputs or null"),
}
# ... or, for lists: (test of an item, words for the items, words for what else may be given)
LIST_TYPES: dict[str, tuple[Callable[[object], bool], str, str]] = {
    "stop": (lambda item: isinstance(item, str), "strings", "a string or "),
    "stop_token_ids": (_is_int, "integers", ""),
}


def _check_list(
    name: str, value: object, is_item: Callable[[object], bool], items: str, alternative: str
) -> None:
    """``value`` is a list (or tuple) whose every item passes ``is_item``."""
    if not isinstance(value, (list, tuple)):
        raise wrong_type(name, f"{alternative}a list of {items}", value)
    for index, item in enumerate(value):
        if not is_item(item):
            raise InvalidRequestError(
                name, f"expected a list of {items}; [{index}] is {describe(item)}"
            )


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
