"""Per-request sampling settings, validated when they are made."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. Penalties follow the usual definitions:
    ``repetition_penalty`` divides positive logits (multiplies negative ones) of every token
    seen in the prompt or output; ``presence_penalty`` subtracts a constant from every token
    seen in the output; ``frequency_penalty`` subtracts once per occurrence in the output.
    """

    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a bare string for stop; store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            _check(isinstance(value, (list, tuple)), name, "must be a list")
            object.__setattr__(self, name, tuple(value))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be >= 1, or 0/-1 for off")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            _is_num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0 (1 = off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        _check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            "must be an integer of 64 bits, in [-2**63, 2**64)",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

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


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
