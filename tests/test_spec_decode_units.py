"""Speculative decoding's parts: prompt lookup, rejection sampling, flag checks.

The statistical tests generate many independent sequences from a small bigram "target" through
rejection sampling of drafts and compare the joint distribution of their first tokens with
the target's own, by a chi-square test; a sampler that mis-states the draft distribution
must fail the same test.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from engine.config import EngineConfig
from engine.config_flags import add_engine_args, engine_config_from_args
from engine.errors import ConfigError
from engine.host_inputs import HostBatch
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledSeq
from engine.sequence import Sequence
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import TokenBuffer
from engine.spec_decode.rejection import DraftLayout, rejection_sample, verify_greedy
from engine.spec_decode.verify import position_rows

VOCAB = 4
SEQ_LEN = 3  # tokens per generated sequence whose joint distribution is tested
NUM_TRIALS = 20_000
MAX_DRAFTS = 3

# -- prompt lookup


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9 10
    text = [5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 1 and 6: the latest (6) is followed by 7, 1, 2
    assert proposer.propose(text, k=3) == [7, 1, 2]
    assert proposer.propose(text, k=1) == [7]
    # a match running into the end goes on with the period it found: [4, 6] repeats
    assert proposer.propose([4, 6, 4], k=5) == [6, 4, 6, 4, 6]
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], k=6) == [9, 1, 2, 3, 9, 1]
    assert proposer.propose([7, 7, 7], k=3) == [7, 7, 7]


def test_ngram_falls_back_to_shorter_suffixes_and_may_find_nothing() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose([1, 2, 8, 9, 3, 2, 8], k=2) == [9, 3]  # only [2, 8] recurs
    assert proposer.propose([1, 2, 3, 4, 5], k=2) == []  # no 2-gram recurs
    assert proposer.propose([1, 2, 3, 4, 1], k=2) == []  # [1] recurs, but min_n is 2
    assert NgramProposer(1, 4).propose([1, 2, 3, 4, 1], k=2) == [2, 3]
    assert proposer.propose([7, 7], k=3) == []  # too short for any 2-gram before the suffix
    assert proposer.propose([7, 7, 7], k=2) == [7, 7]


def _latest_match_by_brute_force(text: list[int], min_n: int, max_n: int) -> int | None:
    """Where the continuation starts: after the latest earlier occurrence of the longest
    suffix of min_n..max_n tokens that recurs (each window compared whole)."""
    for n in range(min(max_n, len(text) - 1), min_n - 1, -1):
        starts = [s for s in range(len(text) - n) if text[s : s + n] == text[-n:]]
        if starts:
            return starts[-1] + n
    return None


def test_ngram_matches_a_brute_force_search_on_random_texts() -> None:
    gen = torch.Generator().manual_seed(0)
    for case in range(2000):
        length = int(torch.randint(1, 30, (1,), generator=gen))
        vocab = int(torch.randint(2, 6, (1,), generator=gen))
        text = torch.randint(0, vocab, (length,), generator=gen).tolist()
        min_n = 1 + case % 3
        max_n = min_n + case % 4
        begin = _latest_match_by_brute_force(text, min_n, max_n)
        got = NgramProposer(min_n, max_n).propose(text, k=3)
        if begin is None or len(text) <= min_n:
            assert got == [], (text, min_n, max_n)
        else:
            assert got[: len(text) - begin] == text[begin : begin + 3], (text, min_n, max_n)


def test_token_buffer_follows_a_growing_sequence() -> None:
    seq = Sequence("r", [1, 2, 3], SamplingParams(), 0.0)
    buffer = TokenBuffer(seq.prompt_token_ids)
    assert buffer.sync(seq).tolist() == [1, 2, 3]
    for step in range(10):  # grows past its first capacity several times
        seq.output_token_ids += [10 + step] * (step % 3)
        assert buffer.sync(seq).tolist() == seq.prompt_token_ids + seq.output_token_ids


# -- greedy verification


def test_greedy_keeps_drafts_while_they_equal_the_argmax() -> None:
    drafts = [[4, 5, 6], [], [9, 9]]
    layout = DraftLayout.build(drafts, torch.device("cpu"))
    # argmax at each flat position: row 0 = 4, 5, 0, 1 (rejects 6); row 1 = 3; row 2 = 9, 9, 2
    target = torch.tensor([4, 5, 0, 1, 3, 9, 9, 2])
    assert verify_greedy(target, layout).tolist() == [2, 0, 2]


# -- rejection sampling keeps the target distribution


def _bigram(concentration: float) -> torch.Tensor:
    """[V, V] row-stochastic: next-token probabilities given the previous token, no entry
    below 0.02 (so that every cell of the chi-square test expects plenty of counts)."""
    rows = torch.distributions.Dirichlet(torch.full((VOCAB,), concentration)).sample((VOCAB,))
    rows = rows.clamp(min=0.02)
    return rows / rows.sum(dim=1, keepdim=True)


def _generate(
    target: torch.Tensor, draft: torch.Tensor | None, claimed_draft: torch.Tensor | None
) -> torch.Tensor:
    """[NUM_TRIALS, SEQ_LEN] tokens from speculative steps starting after token 0.

    ``draft``: the bigram drafts are sampled from, or None for drafts picked without
    randomness (prompt lookup: q is a point mass). ``claimed_draft``: the q the sampler is told.
    """
    outputs: list[list[int]] = [[] for _ in range(NUM_TRIALS)]
    last = torch.zeros(NUM_TRIALS, dtype=torch.int64)
    while min(len(out) for out in outputs) < SEQ_LEN:
        num_drafts = torch.randint(0, MAX_DRAFTS + 1, (NUM_TRIALS,))
        drafts, target_rows, draft_rows = [], [], []
        for trial in range(NUM_TRIALS):
            context = [int(last[trial])]
            for _ in range(int(num_drafts[trial])):
                prev = context[-1]
                if draft is None:  # a fixed guess, like a lookup
                    context.append((prev + 1 + trial % 2) % VOCAB)
                else:
                    context.append(int(torch.multinomial(draft[prev], 1)))
            drafts.append(context[1:])
            target_rows += context
            draft_rows += context
        layout = DraftLayout.build(drafts, torch.device("cpu"))
        probs = target[torch.tensor(target_rows)]  # position j's target: p(. | context[j])
        q = None if claimed_draft is None else claimed_draft[torch.tensor(draft_rows)]
        uniforms = torch.rand(layout.num_positions)
        noise = torch.empty(NUM_TRIALS, VOCAB).exponential_()
        result = rejection_sample(probs, layout, uniforms, noise, q)
        num_accepted = result.num_accepted.tolist()
        next_ids = result.next_token_ids.tolist()
        for trial in range(NUM_TRIALS):
            outputs[trial] += [*drafts[trial][: num_accepted[trial]], next_ids[trial]]
            last[trial] = outputs[trial][-1]
    return torch.tensor([out[:SEQ_LEN] for out in outputs])


def _chi_square_excess(tokens: torch.Tensor, target: torch.Tensor) -> float:
    """Chi-square statistic of the first tokens against the bigram chain, over its 99.99%
    critical value; < 1 passes."""
    index = tokens[:, 0] * VOCAB**2 + tokens[:, 1] * VOCAB + tokens[:, 2]
    observed = torch.bincount(index, minlength=VOCAB**SEQ_LEN).double()
    a, b, c = torch.meshgrid(*[torch.arange(VOCAB)] * 3, indexing="ij")
    expected = (target[0, a] * target[a, b] * target[b, c]).reshape(-1).double() * len(tokens)
    return chi_square_excess(observed, expected)


def chi_square_excess(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic over its 99.99% critical value (Wilson-Hilferty); < 1 passes.
    Cells expecting fewer than 5 counts are pooled into one."""
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof, z = len(expected) - 1, 3.72
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic / critical


@pytest.fixture
def bigrams() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)  # the bigrams, and every draw of the test
    return _bigram(concentration=1.0), _bigram(concentration=0.5)


def test_draft_model_tokens_keep_the_target_distribution(
    bigrams: tuple[torch.Tensor, torch.Tensor],
) -> None:
    target, draft = bigrams
    assert _chi_square_excess(_generate(target, draft, draft), target) < 1


def test_lookup_tokens_keep_the_target_distribution(
    bigrams: tuple[torch.Tensor, torch.Tensor],
) -> None:
    target, _ = bigrams
    assert _chi_square_excess(_generate(target, None, None), target) < 1


def test_the_chi_square_test_catches_a_wrong_draft_distribution(
    bigrams: tuple[torch.Tensor, torch.Tensor],
) -> None:
    target, draft = bigrams
    uniform = torch.full((VOCAB, VOCAB), 1 / VOCAB)
    assert _chi_square_excess(_generate(target, draft, uniform), target) > 3


def test_target_probs_are_what_the_sampler_draws_from() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    greedy = SamplingRow(SamplingParams(temperature=0), [0], [], None)
    top2 = SamplingRow(SamplingParams(temperature=0.5, top_k=2), [0], [], None)
    probs = Sampler(VOCAB).target_probs(logits, [greedy, top2])
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    expected = torch.softmax(torch.tensor([3.0, 2.0]) / 0.5, dim=0)
    torch.testing.assert_close(probs[1], torch.tensor([0.0, expected[0], 0.0, expected[1]]))


def test_each_position_samples_as_if_the_drafts_before_it_were_output() -> None:
    params = SamplingParams(max_tokens=9, min_tokens=4, repetition_penalty=1.2)
    seq = Sequence("r", [7, 8], params, 0.0, eos_token_ids=frozenset({2}))
    seq.output_token_ids = [5, 6]
    rows = position_rows(ScheduledSeq(seq, 4, [10, 11, 12]))
    assert [list(row.output_token_ids) for row in rows] == [
        [5, 6], [5, 6, 10], [5, 6, 10, 11], [5, 6, 10, 11, 12],
    ]  # fmt: skip
    # EOS is suppressed until 4 tokens are out: at positions 0 and 1 (2 and 3 tokens before)
    assert [tuple(row.suppressed_token_ids) for row in rows] == [(2,), (2,), (), ()]


def test_a_verify_row_is_one_decode_row_per_position() -> None:
    """Drafts verify as one-token attention rows over their own prefix, so a step of decodes
    and verifications is a decode step (a graph replay); logits rows: samplers, then drafts."""
    block_size = 4
    plain = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(), 0.0)
    plain.block_table, plain.num_computed_tokens = [7, 8], 5
    plain.output_token_ids = [6]
    drafted = Sequence("b", [1, 2, 3], SamplingParams(), 0.0)
    drafted.block_table, drafted.num_computed_tokens = [3, 9], 3
    drafted.output_token_ids = [4]
    batch = ScheduledBatch([ScheduledSeq(plain, 1), ScheduledSeq(drafted, 3, [50, 51])])
    host = HostBatch.of(batch, block_size)
    inputs = host.inputs
    assert inputs.token_ids == [6, 4, 50, 51]
    assert inputs.positions == [5, 3, 4, 5]
    assert inputs.slots == [8 * 4 + 1, 3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1]
    assert inputs.query_start_loc == [0, 1, 2, 3, 4]  # every row one token
    assert inputs.seq_lens == [6, 4, 5, 6]  # each draft position sees the ones before it
    assert inputs.tables == [[7, 8], [3, 9], [3, 9], [3, 9]]
    assert inputs.logits_indices is None  # the sampler's row, then the drafts': in order
    assert inputs.num_samples == 4
    assert [e.seq for e in host.sampling_entries] == [plain]
    assert [e.seq for e in host.draft_entries] == [drafted]
    # the drafted row first: its rows come last among the logits
    swapped = HostBatch.of(ScheduledBatch(batch.scheduled[::-1]), block_size).inputs
    assert swapped.logits_indices == [3, 0, 1, 2]


# -- flags


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(num_speculative_tokens=3), "add --speculative ngram"),
        (dict(speculative="ngram", num_speculative_tokens=0), "must be >= 1"),
        (dict(speculative="ngram", async_scheduling=True), "async_scheduling does not combine"),
        (dict(speculative="ngram", speculative_ngram_min=3, speculative_ngram_max=2), "min <= max"),
        (dict(speculative="ngram", speculative_ngram_min=0), "min <= max"),
        (
            dict(speculative="ngram", num_speculative_tokens=8, max_batched_tokens=8, max_seqs=4),
            "must fit in max_batched_tokens",
        ),
        (dict(speculative="eagle"), "is not one of off, ngram"),
        (
            dict(speculative_model="dummy:tiny", tensor_parallel_size=2),
            "--speculative-model needs --tensor-parallel-size 1",
        ),
    ],
)
def test_bad_speculative_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_speculative_flags_fill_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "6"])
    config = engine_config_from_args(args)
    assert (config.speculative, config.speculative_tokens()) == ("ngram", 6)
    assert config.async_scheduling_wanted("cuda") is False
    assert EngineConfig(speculative="ngram").speculative_tokens() == 4
    assert EngineConfig().speculative_tokens() == 0
