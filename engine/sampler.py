"""Batched next-token sampling: suppression, penalties, temperature, top-k/top-p/min-p.

One call handles a whole batch with tensor ops; the only Python loops are over rows (per-row
settings, per-row seeded generators), never over vocabulary entries or tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.logits_processors import apply_filters, column, penalize, per_row, suppress_tokens
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probs under the raw model distribution for one sampled token."""

    token_id: int
    logprob: float  # log-prob of the sampled token
    top: tuple[tuple[int, float], ...]  # top-n (token_id, logprob), best first; n = params.logprobs


@dataclass
class SamplingRow:
    """One sequence's view for one sampling step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # set when params.seed is set; persists across steps
    suppressed_token_ids: Sequence[int] = ()  # e.g. EOS ids while len(output) < min_tokens


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded sequence, on the device that samples (a row's noise is then
    drawn there: a CPU draw of a whole vocabulary per seeded row and step, copied over, cost
    0.4 s a step at 128 seeded rows on an H200); it lives as long as the sequence. The same
    seed gives the same tokens on the same kind of device."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks one token per row from a batch of logits.

    Order of operations (vLLM's): raw logprobs, suppression, penalties, then greedy argmax or
    temperature -> top-k -> top-p -> min-p -> exponential-race sampling.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """``logits``: [num_rows, >= vocab_size], any float dtype; padded columns are ignored."""
        return self.sample_on_device(logits, rows).resolve()

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """Argmax of every row of ``logits`` [num_rows, >= vocab_size], no logprobs."""
        return self.greedy_on_device(logits).resolve()

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        """``sample`` without waiting for the device: the picks stay where the logits are."""
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows for {len(rows)} rows"
        logits = logits[:, : self.vocab_size]  # [num_rows, vocab]
        if all(_is_plain_greedy(row) for row in rows):
            return self.greedy_on_device(logits)
        # A float32 copy: we edit it in place and must not touch the caller's tensor.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = _raw_logprobs(logits, rows)
        logits = self.process_logits(logits, rows)
        token_ids = self._pick_tokens(logits, rows)  # [num_rows]
        return DeviceSample(token_ids, _logprob_tensors(raw_logprobs, token_ids, rows))

    def picked_on_device(
        self, logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> DeviceSample:
        """Tokens ``token_ids`` [num_rows] picked elsewhere (rejection sampling of drafts),
        with the raw logprobs of the rows that ask for them."""
        if not _rows_wanting_logprobs(rows):
            return DeviceSample(token_ids, None)
        raw_logprobs = _raw_logprobs(logits[:, : self.vocab_size].float(), rows)
        return DeviceSample(token_ids, _logprob_tensors(raw_logprobs, token_ids, rows))

    def greedy_on_device(self, logits: torch.Tensor) -> DeviceSample:
        return DeviceSample(logits[:, : self.vocab_size].argmax(dim=-1), None)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Suppression then penalties, in place on float32 ``logits`` [num_rows, vocab]."""
        suppress_tokens(logits, rows, self.vocab_size)
        penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if penalized:
            index = torch.tensor(penalized, device=logits.device)
            logits[index] = penalize(logits[index], [rows[i] for i in penalized])
        return logits

    def target_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[num_rows, vocab] float32: the distribution ``sample`` draws each row from (after
        suppression, penalties, temperature and filters); a greedy row is one-hot on its
        argmax. What rejection sampling of draft tokens must preserve."""
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        logits = self.process_logits(logits, rows)
        probs = torch.zeros_like(logits)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            probs[index] = F.one_hot(logits[index].argmax(dim=-1), self.vocab_size).float()
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs[index] = _random_probs(logits[index], [rows[i] for i in random_rows])
        return probs

    def _pick_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[num_rows] token ids: argmax for greedy rows, a random draw for the others."""
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if len(random_rows) == len(rows):
            return _sample_random(logits, rows)
        token_ids = logits.argmax(dim=-1)  # [num_rows]; random rows are overwritten below
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            token_ids[index] = _sample_random(logits[index], [rows[i] for i in random_rows])
        return token_ids


def _is_plain_greedy(row: SamplingRow) -> bool:
    return row.params.is_plain_greedy and not row.suppressed_token_ids


# -- logprobs


def _rows_wanting_logprobs(rows: Sequence[SamplingRow]) -> list[int]:
    return [i for i, row in enumerate(rows) if row.params.logprobs is not None]


def _raw_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
    """log_softmax of the unprocessed logits [num_wanted, vocab] for rows asking for logprobs.

    vLLM's default: logprobs describe the model, not the penalized/filtered distribution.
    """
    wanted = _rows_wanting_logprobs(rows)
    if not wanted:
        return None
    return torch.log_softmax(logits[torch.tensor(wanted, device=logits.device)], dim=-1)


@dataclass(frozen=True)
class _LogprobTensors:
    """The logprobs of the rows that ask for them, still on the device."""

    wanted: list[int]  # row indices
    num_top: list[int]  # top-n per wanted row
    sampled_ids: torch.Tensor  # [num_wanted]
    sampled: torch.Tensor  # [num_wanted]: log-prob of each sampled token
    top_values: torch.Tensor  # [num_wanted, max n], best first
    top_ids: torch.Tensor  # [num_wanted, max n]


def _logprob_tensors(
    raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> _LogprobTensors | None:
    """Sampled-token and top-n logprobs for rows that ask; ``token_ids``: [num_rows]."""
    if raw_logprobs is None:
        return None
    wanted = _rows_wanting_logprobs(rows)
    wanted_ids = token_ids[torch.tensor(wanted, device=token_ids.device)]  # [num_wanted]
    sampled = raw_logprobs.gather(1, wanted_ids.unsqueeze(1)).squeeze(1)  # [num_wanted]
    num_top = [rows[i].params.logprobs or 0 for i in wanted]
    top_values, top_ids = raw_logprobs.topk(max(num_top), dim=-1)
    return _LogprobTensors(wanted, num_top, wanted_ids, sampled, top_values, top_ids)


class DeviceSample:
    """A step's picks (and logprobs) on the device, copied to host memory without blocking.

    ``start_copy`` queues the copies behind the sampling kernels and records an event;
    ``resolve`` waits for that event alone, so the host can launch the next step's forward in
    between without waiting for it (the overlap of asynchronous scheduling).
    """

    def __init__(self, token_ids: torch.Tensor, logprobs: _LogprobTensors | None) -> None:
        self.token_ids = token_ids  # [num_rows] int64, on the device: the next step's inputs
        self._logprobs = logprobs
        self._host: list[torch.Tensor] | None = None
        self._event: torch.cuda.Event | None = None

    def _tensors(self) -> list[torch.Tensor]:
        lp = self._logprobs
        extra = [] if lp is None else [lp.sampled_ids, lp.sampled, lp.top_values, lp.top_ids]
        return [self.token_ids, *extra]

    def start_copy(self) -> None:
        tensors = self._tensors()
        if tensors[0].device.type != "cuda":
            self._host = tensors
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, device in zip(self._host, tensors, strict=True):
            host.copy_(device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def resolve(self) -> SamplerOutput:
        """Host lists of the picks and logprobs (waits for the copies, not for later work)."""
        if self._host is None:
            self.start_copy()
        assert self._host is not None
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host[0].tolist()
        out: list[TokenLogprobs | None] = [None] * len(token_ids)
        lp = self._logprobs
        if lp is not None:
            sampled_ids, sampled, values, ids = (t.tolist() for t in self._host[1:])
            for j, (i, n) in enumerate(zip(lp.wanted, lp.num_top, strict=True)):
                top = tuple(zip(ids[j][:n], values[j][:n], strict=True))
                out[i] = TokenLogprobs(sampled_ids[j], sampled[j], top)
        return SamplerOutput(token_ids, out)


# -- random sampling


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[num_rows] token ids drawn after temperature and the top-k/top-p/min-p filters."""
    probs = _random_probs(logits, rows)
    return exponential_race(probs, draw_noise(rows, logits.shape[1], logits.device))


def _random_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[num_rows, vocab]: softmax after temperature and the top-k/top-p/min-p filters."""
    device = logits.device
    params = [row.params for row in rows]
    vocab = logits.shape[1]
    logits = logits / column([p.temperature for p in params], device)
    # Decide from the Python settings which filters run: checking tensors would sync.
    logits = apply_filters(
        logits,
        # a top-k past the vocabulary keeps every token (and may not fit an int64 tensor)
        top_k=per_row([p.top_k if p.top_k < vocab else 0 for p in params], off=0, device=device),
        top_p=per_row([p.top_p for p in params], off=1.0, device=device),
        min_p=per_row([p.min_p for p in params], off=0.0, device=device),
    )
    return torch.softmax(logits, dim=-1)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / Exp(1) noise) draws index i with probability probs[i], with no sync.

    ``probs`` and ``noise``: [num_rows, vocab]; returns [num_rows] token ids.
    """
    # Exp(1) noise of exactly 0 would turn a filtered-out 0 prob into 0/0 = nan, and argmax
    # prefers nan; clamping keeps filtered tokens at 0.
    noise = noise.clamp(min=torch.finfo(noise.dtype).tiny)
    return torch.argmax(probs / noise, dim=-1)


def draw_noise(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] Exp(1) noise: one batch draw, then seeded rows from their generators.

    A seeded row's noise depends only on its generator, so the same seed gives the same
    tokens whatever else is in the batch.
    """
    noise = torch.empty(len(rows), vocab_size, device=device).exponential_()
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if seeded:
        seeded_noise = torch.stack([_row_noise(rows[i], vocab_size) for i in seeded])
        noise[torch.tensor(seeded, device=device)] = seeded_noise.to(device)
    return noise


def _row_noise(row: SamplingRow, vocab_size: int) -> torch.Tensor:
    assert row.generator is not None
    generator = row.generator
    return torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)
