"""The hand-off types around one step on the device: its inputs as tensors, the step once
launched (picks still on the device), and each row's resolved picks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.host_inputs import HostInputs
from engine.sampler import DeviceSample, TokenLogprobs
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec_decode.verify import VerifiedDrafts


@dataclass(frozen=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprobs: TokenLogprobs | None
    # Draft tokens verified before ``token_id``, in order: they come first, KV already cached
    accepted_draft_ids: tuple[int, ...] = ()
    draft_logprobs: tuple[TokenLogprobs | None, ...] = ()  # theirs, when asked for


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``resolve`` waits for the
    picks alone. Until then the picks feed the next step straight from device memory."""

    scheduled: list[ScheduledSeq]
    sampling_entries: list[ScheduledSeq]  # rows without drafts that sample
    sample: DeviceSample | None  # None when no such row ran
    verified: VerifiedDrafts | None = None  # rows that ran with draft tokens
    # Logits not sampled yet: a row's grammar needs the tokens of the step before first
    # (``ModelRunner.sample_constrained``); [S + N, V], with the rows that have drafts
    unsampled_logits: torch.Tensor | None = None
    draft_entries: list[ScheduledSeq] = field(default_factory=list)

    def row_of(self) -> dict[int, int]:
        """``id(seq)`` -> its row in ``sample.token_ids``."""
        return {id(entry.seq): row for row, entry in enumerate(self.sampling_entries)}

    def resolve(self) -> list[SampledToken]:
        tokens = []
        if self.sample is not None:
            out = self.sample.resolve()
            tokens = [
                SampledToken(entry.seq, token_id, logprobs)
                for entry, token_id, logprobs in zip(
                    self.sampling_entries, out.token_ids, out.logprobs, strict=True
                )
            ]
        if self.verified is not None:
            for entry, (ids, logprobs) in zip(
                self.verified.entries, self.verified.resolve(), strict=True
            ):
                token = SampledToken(
                    entry.seq, ids[-1], logprobs[-1], tuple(ids[:-1]), tuple(logprobs[:-1])
                )
                tokens.append(token)
        return tokens


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [S + N]: last token of each sequence that samples, then every position of the rows
    # with drafts; None when every token samples in that order (decode)
    logits_indices: torch.Tensor | None
    sampling_entries: list[ScheduledSeq]  # empty on ranks other than 0
    host: HostInputs  # what the tensors were built from
    draft_entries: list[ScheduledSeq]  # rows with draft tokens, on rank 0
