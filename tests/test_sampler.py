"""Sampler: filters, penalties, greedy, seeds, distributions and logprobs on fixed logits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.logits_processors import apply_filters, apply_penalties, count_tokens
from engine.sampler import Sampler, SamplingRow, make_generator
from engine.sampling_params import SamplingParams

NUM_DRAWS = 20_000
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _fixed_default_seed() -> None:
    # Unseeded rows draw from the default generator; pin it so every run is the same.
    torch.manual_seed(0)


def make_row(
    params: SamplingParams | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    suppressed: Sequence[int] = (),
) -> SamplingRow:
    params = params or SamplingParams()
    generator = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(params, prompt, output, generator, suppressed)


def log_probs(*probs: float) -> list[float]:
    """Logits whose softmax is exactly ``probs`` (powers of two stay exact in float32)."""
    return [math.log(p) for p in probs]


def kept(logits: list[float], **filters: float) -> set[int]:
    """Token ids that survive apply_filters for one row."""
    tensors = {name: torch.tensor([value]) for name, value in filters.items()}
    out = apply_filters(torch.tensor([logits]), **tensors)
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


def draw_many(logits: list[float], params: SamplingParams, num_draws: int) -> torch.Tensor:
    """[num_draws] tokens: one batch of identical unseeded rows."""
    sampler = Sampler(vocab_size=len(logits))
    batch = torch.tensor([logits]).expand(num_draws, -1)
    rows = [make_row(params) for _ in range(num_draws)]
    return torch.tensor(sampler.sample(batch, rows).token_ids)


# -- filters


def test_top_k_keeps_the_k_largest() -> None:
    logits = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert kept(logits, top_k=1) == {0}
    assert kept(logits, top_k=2) == {0, 2}
    assert kept(logits, top_k=4) == {0, 2, 3, 4}
    assert kept(logits, top_k=0) == {0, 1, 2, 3, 4}  # off
    assert kept(logits, top_k=99) == {0, 1, 2, 3, 4}  # more than the vocab


def test_a_top_k_past_64_bits_samples_as_top_k_off() -> None:
    """The worker's protocol carries integers up to 2**64 - 1: such a top-k keeps every token
    (it used to make the whole step fail building the batch's top-k tensor)."""
    logits = torch.tensor([[1.0, 0.5, 0.25, 0.0]] * 2)
    huge, off = (SamplingParams(top_k=k, seed=3) for k in (2**64 - 1, 0))
    sampler = Sampler(vocab_size=4)
    mixed = sampler.sample(logits, [make_row(huge), make_row(SamplingParams(top_k=2, seed=4))])
    assert mixed.token_ids[0] == sampler.sample(logits[:1], [make_row(off)]).token_ids[0]


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    assert kept([3.0, 3.0, 1.0], top_k=1) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = log_probs(0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125)
    assert kept(logits, top_p=0.1) == {0}  # the top token always stays
    assert kept(logits, top_p=0.6) == {0, 1}
    assert kept(logits, top_p=0.8) == {0, 1, 2}
    assert kept(logits, top_p=1.0) == {0, 1, 2, 3, 4, 5}


def test_top_p_boundary_where_cumulative_equals_top_p() -> None:
    logits = log_probs(0.5, 0.25, 0.125, 0.0625, 0.0625)
    # 0.5 + 0.25 == 0.75 exactly: those two already reach top_p, so 2 is not needed.
    assert kept(logits, top_p=0.75) == {0, 1}
    assert kept(logits, top_p=0.5) == {0}
    assert kept(logits, top_p=0.7501) == {0, 1, 2}


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_prob() -> None:
    logits = log_probs(0.5, 0.25, 0.125, 0.125)
    assert kept(logits, min_p=0.5) == {0, 1}  # 0.25 == 0.5 * 0.5 stays
    assert kept(logits, min_p=0.3) == {0, 1}
    assert kept(logits, min_p=0.2) == {0, 1, 2, 3}
    assert kept(logits, min_p=1.0) == {0}
    assert kept(logits, min_p=0.0) == {0, 1, 2, 3}


def test_top_p_sees_the_top_k_renormalized_distribution() -> None:
    logits = log_probs(0.5, 0.25, 0.125, 0.0625, 0.0625)
    # After top-k=2 the probs are (2/3, 1/3): 2/3 >= 0.6 already. On raw probs 0.5 < 0.6.
    assert kept(logits, top_k=2, top_p=0.6) == {0}
    assert kept(logits, top_p=0.6) == {0, 1}


def test_min_p_runs_after_top_p() -> None:
    logits = log_probs(0.4, 0.35, 0.15, 0.1)
    # top-p 0.8 first keeps {0, 1, 2}; min-p 0.3 (threshold 0.12) keeps them all. The other
    # order (min-p, then top-p on the renormalized {0, 1, 2}) would drop token 2.
    assert kept(logits, top_p=0.8, min_p=0.3) == {0, 1, 2}


def test_row_with_filters_off_is_unchanged_next_to_filtered_rows() -> None:
    logits = torch.randn(3, 50)
    out = apply_filters(
        logits,
        top_k=torch.tensor([0, 5, 0]),
        top_p=torch.tensor([1.0, 1.0, 0.5]),
        min_p=torch.tensor([0.0, 0.1, 0.0]),
    )
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1]).sum() >= 45
    assert torch.isinf(out[2]).any()


def test_top_p_of_one_keeps_a_negligible_tail() -> None:
    # The float32 cumsum reaches 1.0 after token 0; top_p == 1 must still keep the tail.
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0], [30.0, 0.0, 0.0, 0.0]])
    out = apply_filters(logits, top_p=torch.tensor([1.0, 0.99]))
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1, 1:]).all()


@settings(max_examples=50, deadline=None)
@given(
    logits=st.lists(st.floats(-10, 10), min_size=2, max_size=30),
    top_k=st.integers(0, 30),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_keep_a_top_slice_that_includes_the_best(
    logits: list[float], top_k: int, top_p: float, min_p: float
) -> None:
    values = torch.tensor(logits).tolist()  # compare what the sampler sees: float32
    survivors = kept(values, top_k=top_k, top_p=top_p, min_p=min_p)
    assert max(values[i] for i in survivors) == max(values)
    worst_kept = min(values[i] for i in survivors)
    # Filters keep by rank: nothing better than a survivor is dropped.
    assert all(i in survivors for i, value in enumerate(values) if value > worst_kept)


def test_sampler_only_draws_tokens_the_filters_keep() -> None:
    logits = [5.0, 1.0, 4.5, 2.0, 4.0]
    tokens = draw_many(logits, SamplingParams(top_k=2), num_draws=2000)
    assert set(tokens.tolist()) == {0, 2}
    tokens = draw_many(logits, SamplingParams(top_k=3), num_draws=2000)
    assert set(tokens.tolist()) == {0, 2, 4}
    # Relative to token 0, token 4 has prob e^-1 ~ 0.37 < 0.5 and token 2 e^-0.5 ~ 0.61.
    tokens = draw_many(logits, SamplingParams(top_k=3, min_p=0.5), num_draws=2000)
    assert set(tokens.tolist()) == {0, 2}


# -- distributions


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_match_the_softmax(temperature: float) -> None:
    logits = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]
    tokens = draw_many(logits, SamplingParams(temperature=temperature), NUM_DRAWS)
    assert_matches_softmax(tokens, logits, temperature)


def test_seeded_rows_follow_the_softmax_too() -> None:
    logits = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]
    sampler = Sampler(vocab_size=len(logits))
    batch = torch.tensor([logits]).expand(NUM_DRAWS, -1)
    rows = [make_row(SamplingParams(temperature=0.5, seed=seed)) for seed in range(NUM_DRAWS)]
    tokens = torch.tensor(sampler.sample(batch, rows).token_ids)
    assert_matches_softmax(tokens, logits, temperature=0.5)


def assert_matches_softmax(tokens: torch.Tensor, logits: list[float], temperature: float) -> None:
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
    observed = torch.bincount(tokens, minlength=len(logits)) / len(tokens)
    assert (observed - expected).abs().max() < 0.01, (observed, expected)


# -- seeds


def run_steps(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], num_steps: int
) -> list[list[int]]:
    """Token ids per row over ``num_steps`` steps, feeding each row its own output."""
    outputs: list[list[int]] = [[] for _ in rows]
    for _ in range(num_steps):
        for row, out in zip(rows, outputs, strict=True):
            row.output_token_ids = list(out)
        for out, token_id in zip(outputs, sampler.sample(logits, rows).token_ids, strict=True):
            out.append(token_id)
    return outputs


def test_same_seed_gives_same_tokens_whatever_the_batch() -> None:
    vocab_size, num_steps = 1000, 20
    sampler = Sampler(vocab_size)
    logits = torch.randn(1, vocab_size)
    seeded = SamplingParams(seed=1234, top_p=0.9)
    alone = run_steps(sampler, logits, [make_row(seeded)], num_steps)[0]
    neighbours = [
        make_row(SamplingParams()),
        make_row(SamplingParams(temperature=0)),
        make_row(seeded),
        make_row(SamplingParams(seed=5, top_k=3, presence_penalty=1.0)),
    ]
    in_batch = run_steps(sampler, logits.expand(4, -1), neighbours, num_steps)[2]
    assert in_batch == alone
    assert len(set(alone)) > 1  # the generator advances between steps


def test_different_seeds_give_different_tokens() -> None:
    sampler = Sampler(vocab_size=1000)
    logits = torch.zeros(2, 1000)
    rows = [make_row(SamplingParams(seed=1)), make_row(SamplingParams(seed=2))]
    first, second = run_steps(sampler, logits, rows, num_steps=10)
    assert first != second


def test_unseeded_rows_share_the_default_generator() -> None:
    sampler = Sampler(vocab_size=1000)
    logits = torch.zeros(2, 1000)
    first, second = sampler.sample(logits, [make_row(), make_row()]).token_ids
    assert first != second  # independent draws, not one draw copied


# -- penalties


PENALTY_LOGITS = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]


def processed(params: SamplingParams, logits: list[float] = PENALTY_LOGITS) -> list[float]:
    sampler = Sampler(vocab_size=len(logits))
    row = make_row(params, prompt=PROMPT, output=OUTPUT)
    return sampler.process_logits(torch.tensor([logits]), [row])[0].tolist()


def test_repetition_penalty_covers_prompt_and_output() -> None:
    # Seen: 0, 1 (prompt) and 2, 3 (output). Positive logits divide, negative ones multiply.
    assert processed(SamplingParams(repetition_penalty=2.0)) == [1.0, -2.0, 0.25, -1.0, 3.0, 0.0]


def test_presence_penalty_covers_output_only_once_per_token() -> None:
    assert processed(SamplingParams(presence_penalty=0.5)) == [2.0, -1.0, 0.0, -1.0, 3.0, 0.0]


def test_frequency_penalty_counts_output_occurrences() -> None:
    # Token 2 occurs twice, token 3 once; prompt tokens are not counted.
    assert processed(SamplingParams(frequency_penalty=0.25)) == [2.0, -1.0, 0.0, -0.75, 3.0, 0.0]


def test_penalties_combine_repetition_first() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Token 2: 0.5 / 2 - 2 * 0.25 - 0.5; token 3: -0.5 * 2 - 0.25 - 0.5.
    assert processed(params) == [1.0, -2.0, -0.75, -1.75, 3.0, 0.0]


def test_penalties_leave_other_rows_alone() -> None:
    sampler = Sampler(vocab_size=6)
    logits = torch.tensor([PENALTY_LOGITS, PENALTY_LOGITS])
    rows = [
        make_row(SamplingParams(repetition_penalty=2.0), prompt=PROMPT, output=OUTPUT),
        make_row(SamplingParams(), prompt=PROMPT, output=OUTPUT),
    ]
    out = sampler.process_logits(logits.clone(), rows)
    assert out[1].tolist() == PENALTY_LOGITS
    assert out[0].tolist() != PENALTY_LOGITS


def test_count_tokens_counts_per_row() -> None:
    counts = count_tokens([[1, 1, 3], [], [0]], vocab_size=4, device=torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_apply_penalties_matches_the_definitions() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    out = apply_penalties(
        logits,
        prompt_mask=torch.tensor([[True, False, False]]),
        output_counts=torch.tensor([[0.0, 3.0, 0.0]]),
        repetition=torch.tensor([[4.0]]),
        presence=torch.tensor([[1.0]]),
        frequency=torch.tensor([[0.5]]),
    )
    assert out.tolist() == [[0.25, -1.0 * 4 - 0.5 * 3 - 1.0, 2.0]]


# -- greedy, suppression, padding


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    sampler = Sampler(vocab_size=50)
    logits = torch.randn(8, 50)
    greedy = [make_row(SamplingParams(temperature=0)) for _ in range(8)]
    assert sampler.sample(logits, greedy).token_ids == logits.argmax(dim=-1).tolist()
    tied = torch.tensor([[1.0, 3.0, 3.0]])
    assert Sampler(3).sample(tied, greedy[:1]).token_ids == [1]


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-44])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    """logits / 1e-38 overflow float32: the row would be infinities (NaN probabilities, and
    token 0 picked); under 1e-5 a row samples as temperature 0 does."""
    logits = torch.randn(6, 50) * 5
    rows = [make_row(SamplingParams(temperature=temperature, seed=i)) for i in range(6)]
    assert Sampler(50).sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    sampler = Sampler(vocab_size=50)
    logits = torch.randn(4, 50)
    rows = [make_row(SamplingParams(temperature=0 if i % 2 else 1.0)) for i in range(4)]
    token_ids = sampler.sample(logits, rows).token_ids
    assert token_ids[1::2] == logits[1::2].argmax(dim=-1).tolist()


def test_greedy_follows_the_penalized_logits() -> None:
    logits = torch.tensor([[2.0, 1.9]])
    row = make_row(SamplingParams(temperature=0, presence_penalty=0.5), output=[0])
    assert Sampler(2).sample(logits, [row]).token_ids == [1]


def test_greedy_accepts_half_precision() -> None:
    logits = torch.randn(4, 50).to(torch.bfloat16)
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(4)]
    assert Sampler(50).sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_suppressed_ids_are_never_chosen() -> None:
    sampler = Sampler(vocab_size=4)
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    greedy = make_row(SamplingParams(temperature=0), suppressed=[0, 99])  # 99: past the vocab
    assert sampler.sample(logits, [greedy]).token_ids == [1]
    rows = [make_row(suppressed=[0, 1]) for _ in range(2000)]
    tokens = sampler.sample(logits.expand(2000, -1), rows).token_ids
    assert set(tokens) == {2, 3}


def test_padded_vocab_columns_are_never_sampled() -> None:
    vocab_size = 6
    sampler = Sampler(vocab_size)
    logits = torch.cat([torch.zeros(2000, vocab_size), torch.full((2000, 4), 100.0)], dim=1)
    rows = [make_row(SamplingParams(logprobs=5)) for _ in range(1000)]
    rows += [make_row(SamplingParams(temperature=0)) for _ in range(1000)]
    out = sampler.sample(logits, rows)
    assert max(out.token_ids) < vocab_size
    first = out.logprobs[0]
    assert first is not None
    assert all(token_id < vocab_size for token_id, _ in first.top)
    assert first.logprob == pytest.approx(-math.log(vocab_size))  # normalized over the vocab


def test_callers_logits_are_not_modified() -> None:
    logits = torch.randn(2, 12)
    before = logits.clone()
    rows = [
        make_row(SamplingParams(repetition_penalty=1.5), prompt=[1, 2], suppressed=[3]),
        make_row(SamplingParams(temperature=0.7, top_k=3, logprobs=2)),
    ]
    Sampler(vocab_size=10).sample(logits, rows)
    assert torch.equal(logits, before)


# -- logprobs


def test_logprobs_are_of_the_raw_distribution() -> None:
    sampler = Sampler(vocab_size=30)
    logits = torch.randn(3, 30).to(torch.bfloat16)
    rows = [
        make_row(SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.3), prompt=[4]),
        make_row(SamplingParams(logprobs=None)),
        make_row(SamplingParams(logprobs=0, top_k=2), suppressed=[7]),
    ]
    out = sampler.sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[1] is None
    for i in (0, 2):
        entry = out.logprobs[i]
        assert entry is not None
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(raw[i, entry.token_id].item(), abs=1e-6)
    top = out.logprobs[0].top if out.logprobs[0] else ()
    values, ids = raw[0].topk(3)
    assert [token_id for token_id, _ in top] == ids.tolist()
    assert [logprob for _, logprob in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert [logprob for _, logprob in top] == sorted((lp for _, lp in top), reverse=True)
    assert out.logprobs[2] is not None and out.logprobs[2].top == ()


def test_no_logprobs_requested_gives_all_none() -> None:
    out = Sampler(10).sample(torch.randn(2, 10), [make_row(), make_row()])
    assert out.logprobs == [None, None]
