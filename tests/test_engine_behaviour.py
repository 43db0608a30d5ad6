"""Engine behaviour through the step API: abort, deadlines, priority, preemption, quotas,
chunked prefill, seeds, stop conditions, logprobs, stats and request ids.

Greedy outputs are checked against transformers on the same tiny random weights: scheduling
decides *when* a sequence runs, never *what* it produces.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import (
    LLM,
    EngineConfig,
    FinishReason,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    StepOutput,
)
from engine.sequence import Sequence, SequenceStatus
from tests.conftest import TINY_COMMON, hf_greedy, random_prompts

VOCAB_SIZE = TINY_COMMON["vocab_size"]
MAX_STEPS = 2_000  # a runaway engine fails the test instead of hanging it
DEADLINE_S = 1.0  # a loaded machine (2 test processes, 2 cores) still admits a request within it


def greedy(num_tokens: int) -> SamplingParams:
    # min_tokens == max_tokens: EOS is suppressed exactly as in hf_greedy (min_new_tokens).
    return SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens)


@dataclass
class Stream:
    """Everything one request produced, folded from its step outputs."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    num_outputs_after_finish: int = 0


class Driver:
    """Steps an engine and folds its outputs into one ``Stream`` per request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.streams: dict[str, Stream] = {}
        self.num_steps = 0

    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams, **kw: Any) -> None:
        self.engine.add_request(request_id, prompt_token_ids=prompt, sampling=sampling, **kw)
        self.streams[request_id] = Stream()

    def step(self) -> list[StepOutput]:
        outputs = self.engine.step()
        self.num_steps += 1
        for out in outputs:
            stream = self.streams[out.request_id]
            if stream.finish_reason is not None:
                stream.num_outputs_after_finish += 1
            if out.new_token_ids and stream.first_token_step is None:
                stream.first_token_step = self.num_steps
            stream.token_ids += out.new_token_ids
            if out.finished:
                stream.finish_reason, stream.stop_reason = out.finish_reason, out.stop_reason
                stream.finish_step = self.num_steps
        return outputs

    def run(self) -> None:
        while self.engine.has_unfinished_requests():
            assert self.num_steps < MAX_STEPS, "the engine stopped making progress"
            self.step()
        assert all(s.num_outputs_after_finish == 0 for s in self.streams.values())
        assert self.engine.block_manager.num_used_blocks == 0, "finished requests kept pages"

    def tokens(self, request_ids: Iterable[str]) -> list[list[int]]:
        return [self.streams[rid].token_ids for rid in request_ids]


def make_engine(model_dir: Path | str, **settings: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def pages_of(engine: LLMEngine) -> dict[str, int]:
    return {seq.request_id: len(seq.block_table) for seq in engine.scheduler.all_sequences()}


def only_output(outputs: list[StepOutput], request_id: str) -> StepOutput:
    mine = [out for out in outputs if out.request_id == request_id]
    assert len(mine) == 1, f"{request_id}: {len(mine)} outputs in one step"
    return mine[0]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


# -- abort and deadlines ------------------------------------------------------------------


def test_abort_ends_the_request_and_frees_its_pages_in_the_next_step(llama_dir: Path) -> None:
    prompts = random_prompts([10, 25, 40], VOCAB_SIZE, seed=11)
    expected = hf_greedy(llama_dir, prompts, 24)
    ids = ["keep-0", "victim", "keep-2"]
    driver = Driver(make_engine(llama_dir, pa_block_size=8))
    for rid, prompt in zip(ids, prompts, strict=True):
        driver.add(rid, prompt, greedy(24))
    for _ in range(5):
        driver.step()
    engine = driver.engine
    assert engine.sequence("victim") is not None
    pages_before, used_before = pages_of(engine), engine.block_manager.num_used_blocks

    engine.abort("victim")
    outputs = driver.step()

    out = only_output(outputs, "victim")
    assert out.finished and out.finish_reason == FinishReason.CANCELLED
    assert out.new_token_ids == []
    assert out.usage is not None and out.usage.completion_tokens == 5
    grown = sum(n - pages_before[rid] for rid, n in pages_of(engine).items())
    assert pages_before["victim"] > 0
    assert engine.block_manager.num_used_blocks == used_before - pages_before["victim"] + grown
    assert engine.sequence("victim") is None
    driver.run()
    assert driver.tokens(["keep-0", "keep-2"]) == [expected[0], expected[2]]
    assert driver.streams["victim"].token_ids == expected[1][:5]
    assert driver.streams["keep-0"].finish_reason == FinishReason.LENGTH


def test_abort_of_a_waiting_request(llama_dir: Path) -> None:
    prompts = random_prompts([12, 12], VOCAB_SIZE, seed=12)
    driver = Driver(make_engine(llama_dir, max_seqs=1))
    driver.add("running", prompts[0], greedy(8))
    driver.add("queued", prompts[1], greedy(8))
    driver.step()
    assert driver.engine.scheduler.find("queued") in driver.engine.scheduler.waiting
    driver.engine.abort("queued")
    out = only_output(driver.step(), "queued")
    assert out.finished and out.finish_reason == FinishReason.CANCELLED
    driver.run()
    assert driver.streams["queued"].token_ids == []
    assert driver.tokens(["running"]) == hf_greedy(llama_dir, prompts[:1], 8)


def test_running_request_times_out_and_frees_its_pages(llama_dir: Path) -> None:
    prompts = random_prompts([20, 15], VOCAB_SIZE, seed=13)
    driver = Driver(make_engine(llama_dir, pa_block_size=8))
    driver.add("slow", prompts[0], greedy(200), timeout_s=DEADLINE_S)  # would run 200 steps
    driver.add("steady", prompts[1], greedy(24))
    driver.step()
    engine = driver.engine
    slow = engine.sequence("slow")
    assert slow is not None and slow.status is SequenceStatus.RUNNING
    time.sleep(DEADLINE_S * 1.5)
    pages_before, used_before = pages_of(engine), engine.block_manager.num_used_blocks

    out = only_output(driver.step(), "slow")

    assert out.finished and out.finish_reason == FinishReason.TIMEOUT
    grown = sum(n - pages_before[rid] for rid, n in pages_of(engine).items())
    assert engine.block_manager.num_used_blocks == used_before - pages_before["slow"] + grown
    assert engine.sequence("slow") is None
    driver.run()
    assert driver.streams["slow"].token_ids == hf_greedy(llama_dir, prompts[:1], 1)[0]
    assert driver.tokens(["steady"]) == hf_greedy(llama_dir, prompts[1:], 24)
    assert driver.streams["steady"].finish_reason == FinishReason.LENGTH


def test_waiting_request_times_out_in_the_queue(llama_dir: Path) -> None:
    prompts = random_prompts([12, 12], VOCAB_SIZE, seed=14)
    driver = Driver(make_engine(llama_dir, max_seqs=1))
    driver.add("running", prompts[0], greedy(16))
    driver.add("queued", prompts[1], greedy(16), timeout_s=DEADLINE_S)
    driver.step()
    assert driver.engine.sequence("queued") in driver.engine.scheduler.waiting
    time.sleep(DEADLINE_S * 1.5)
    out = only_output(driver.step(), "queued")
    assert out.finished and out.finish_reason == FinishReason.TIMEOUT
    assert out.usage is not None and out.usage.completion_tokens == 0
    driver.run()
    assert driver.tokens(["running"]) == hf_greedy(llama_dir, prompts[:1], 16)


# -- priority, preemption, quotas ---------------------------------------------------------


def test_lower_priority_value_runs_first(llama_dir: Path) -> None:
    prompts = random_prompts([8, 9, 10, 11], VOCAB_SIZE, seed=15)
    driver = Driver(make_engine(llama_dir, max_seqs=1))
    driver.add("first", prompts[0], greedy(4), priority=0)
    driver.step()  # "first" is running: a later request of its priority waits, never evicts it
    driver.add("early", prompts[1], greedy(4), priority=1)
    driver.add("late-low", prompts[2], greedy(4), priority=2)
    driver.add("late-urgent", prompts[3], greedy(4), priority=0)
    driver.run()
    by_start = sorted(driver.streams, key=lambda rid: driver.streams[rid].first_token_step or 0)
    assert by_start == ["first", "late-urgent", "early", "late-low"]
    by_end = sorted(driver.streams, key=lambda rid: driver.streams[rid].finish_step or 0)
    assert by_end == by_start
    assert driver.tokens(by_start) == hf_greedy(llama_dir, [prompts[i] for i in (0, 3, 1, 2)], 4)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_takes_the_lowest_priority_newest_sequence(
    preemption: str, llama_dir: Path
) -> None:
    # A pool of 8 pages of 16 tokens, filled by the 4 prompts (2 pages each). "high-old" is
    # the first to need a third page: a lower-priority, newer sequence must make room.
    ids, priorities = ["low-old", "low-new", "high-old", "high-new"], [1, 1, 0, 0]
    prompts = random_prompts([20, 20, 31, 20], VOCAB_SIZE, seed=16)
    settings = dict(pa_block_size=16, pa_context_len=128, max_model_len=128, swap_space_mb=8)
    driver = Driver(make_engine(llama_dir, preemption=preemption, **settings))
    for rid, prompt, priority in zip(ids, prompts, priorities, strict=True):
        driver.add(rid, prompt, greedy(20), priority=priority)
    driver.step()
    engine = driver.engine
    seqs: dict[str, Sequence] = {rid: s for rid in ids if (s := engine.sequence(rid))}
    assert len(seqs) == 4 and all(s.status is SequenceStatus.RUNNING for s in seqs.values())
    assert engine.block_manager.num_free_blocks == 0
    first_preempted: set[str] = set()
    while engine.has_unfinished_requests() and not first_preempted:
        driver.step()
        first_preempted = {rid for rid, s in seqs.items() if s.num_preemptions}
        engine.block_manager.check_invariants(engine.scheduler.running)
    assert first_preempted == {"low-new"}
    driver.run()
    assert seqs["high-old"].num_preemptions == seqs["high-new"].num_preemptions == 0
    assert engine.stats().num_preemptions >= 1
    assert driver.tokens(ids) == hf_greedy(llama_dir, prompts, 20)  # nothing lost or changed
    assert all(driver.streams[rid].finish_reason == FinishReason.LENGTH for rid in ids)


def test_tenant_quota_caps_the_tenants_pages(llama_dir: Path) -> None:
    # Each sequence needs 3 pages of 16 at most, so a quota of 4 lets tenant "a" hold one
    # sequence's pages (and the start of another), never two whole sequences.
    quota = 4
    prompts = random_prompts([20] * 6, VOCAB_SIZE, seed=17)
    engine = make_engine(llama_dir, pa_block_size=16, tenant_page_quotas={"a": quota})
    driver = Driver(engine)
    tenants = ["a", "b", "a", "b", "a", "b"]
    ids = [f"{tenant}{i}" for i, tenant in enumerate(tenants)]
    for rid, prompt, tenant in zip(ids, prompts, tenants, strict=True):
        driver.add(rid, prompt, greedy(20), tenant=tenant)
    max_pages = {"a": 0, "b": 0}
    max_running = {"a": 0, "b": 0}
    while engine.has_unfinished_requests():
        assert driver.num_steps < MAX_STEPS
        driver.step()
        for tenant in max_pages:
            pages = engine.block_manager.tenant_pages[tenant]
            running = sum(seq.tenant == tenant for seq in engine.scheduler.running)
            max_pages[tenant] = max(max_pages[tenant], pages)
            max_running[tenant] = max(max_running[tenant], running)
        assert engine.block_manager.tenant_pages["a"] <= quota, f"step {driver.num_steps}"
    assert max_running["a"] < 3, "the quota never held tenant a back"
    assert max_pages["b"] == 9 and max_running["b"] == 3, "tenant b must run unthrottled"
    driver.run()
    assert driver.tokens(ids) == hf_greedy(llama_dir, prompts, 20)


# -- chunked prefill -----------------------------------------------------------------------


def test_long_prefill_in_chunks_never_stalls_running_decodes(llama_dir: Path) -> None:
    prompts = random_prompts([6, 9, 100], VOCAB_SIZE, seed=18)
    chunk = 8
    engine = make_engine(llama_dir, prefill_chunk=chunk, max_batched_tokens=16, max_seqs=4)
    driver = Driver(engine)
    driver.add("decode-0", prompts[0], greedy(40))
    driver.add("decode-1", prompts[1], greedy(40))
    driver.step()  # both prompts fit one chunk: both are decoding from here on
    driver.add("long", prompts[2], greedy(4))
    num_prefill_steps = 0
    while not driver.streams["long"].token_ids:
        before = {rid: len(driver.streams[rid].token_ids) for rid in ("decode-0", "decode-1")}
        driver.step()
        num_prefill_steps += 1
        after = {rid: len(driver.streams[rid].token_ids) for rid in ("decode-0", "decode-1")}
        assert after == {rid: n + 1 for rid, n in before.items()}, f"step {num_prefill_steps}"
    assert num_prefill_steps >= -(-len(prompts[2]) // chunk)  # it really was chunked
    driver.run()
    expected = hf_greedy(llama_dir, prompts, 40)
    assert driver.tokens(["decode-0", "decode-1", "long"]) == [*expected[:2], expected[2][:4]]


# -- sampling ------------------------------------------------------------------------------


def test_seeded_request_is_reproducible_alone_and_in_a_batch() -> None:
    # dummy:tiny has near-uniform logits, so any change in the random stream changes tokens.
    llm = LLM("dummy:tiny", max_seqs=8)
    prompt, others = [5, 6, 7, 8, 9], random_prompts([7, 30, 3], 512, seed=19)

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=seed, max_tokens=16, ignore_eos=True)

    alone = llm.generate([prompt], seeded(1234), use_tqdm=False)[0].token_ids
    batch = [others[0], others[1], prompt, others[2], prompt]
    params = [
        SamplingParams(temperature=1.0, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=5),
        seeded(1234),
        seeded(1234),
        seeded(99),
    ]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert len(alone) == 16
    assert outputs[2].token_ids == alone
    assert outputs[4].token_ids != alone, "a different seed gave the same tokens"
    other_seed = llm.generate([prompt], seeded(99), use_tqdm=False)[0].token_ids
    assert other_seed == outputs[4].token_ids


@pytest.fixture(scope="module")
def reference_run(llama_dir: Path) -> tuple[list[int], list[int]]:
    """A prompt and its first 24 greedy tokens (EOS not suppressed: none is configured)."""
    prompt = random_prompts([12], VOCAB_SIZE, seed=20)[0]
    return prompt, hf_greedy(llama_dir, [prompt], 24)[0]


def first_new_token_index(tokens: list[int], start: int) -> int:
    """The first index >= ``start`` whose token does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def eos_model(
    llama_dir: Path, reference_run: tuple[list[int], list[int]], tmp_path_factory: Any
) -> tuple[Path, int, int]:
    """The llama weights with EOS set to a token greedy produces early; (dir, eos, index)."""
    _, expected = reference_run
    index = first_new_token_index(expected, 2)
    eos = expected[index]
    model_dir = tmp_path_factory.mktemp("eos-model") / "llama"
    shutil.copytree(llama_dir, model_dir)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(config))
    return model_dir, eos, index


def test_eos_stops_and_ignore_eos_does_not(
    eos_model: tuple[Path, int, int], reference_run: tuple[list[int], list[int]]
) -> None:
    model_dir, eos, index = eos_model
    prompt, expected = reference_run
    llm = LLM(str(model_dir))
    stopped, ignored = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert stopped.token_ids == expected[: index + 1] and stopped.token_ids[-1] == eos
    assert stopped.finish_reason == FinishReason.STOP and stopped.stop_reason is None
    assert ignored.token_ids == expected[:12]
    assert ignored.finish_reason == FinishReason.LENGTH


def test_min_tokens_suppresses_eos_and_stop_tokens(
    eos_model: tuple[Path, int, int], reference_run: tuple[list[int], list[int]]
) -> None:
    model_dir, eos, index = eos_model
    prompt, expected = reference_run
    min_tokens = index + 4
    llm = LLM(str(model_dir))
    sampling = SamplingParams(temperature=0, max_tokens=24, min_tokens=min_tokens)
    out = llm.generate([prompt], sampling, use_tqdm=False)[0]
    assert out.token_ids[:index] == expected[:index]  # greedy until EOS would come
    assert eos not in out.token_ids[:min_tokens] and len(out.token_ids) >= min_tokens
    if out.finish_reason == FinishReason.STOP:
        assert out.token_ids[-1] == eos
    else:
        assert len(out.token_ids) == 24
    # A stop token id is held back by min_tokens just like EOS.
    stop_id = out.token_ids[1]
    sampling = SamplingParams(temperature=0, max_tokens=24, min_tokens=3, stop_token_ids=(stop_id,))
    out = llm.generate([prompt], sampling, use_tqdm=False)[0]
    assert stop_id not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_stop_token_id_stops_with_its_id_as_reason(
    llama_dir: Path, reference_run: tuple[list[int], list[int]]
) -> None:
    prompt, expected = reference_run
    index = first_new_token_index(expected, 4)
    llm = LLM(str(llama_dir))
    sampling = SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=(expected[index],), ignore_eos=True
    )
    out = llm.generate([prompt], sampling, use_tqdm=False)[0]
    assert out.token_ids == expected[: index + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == expected[index]


def test_max_tokens_and_max_model_len_end_with_length(
    llama_dir: Path, reference_run: tuple[list[int], list[int]]
) -> None:
    prompt, expected = reference_run
    out = LLM(str(llama_dir)).generate([prompt], greedy(5), use_tqdm=False)[0]
    assert out.token_ids == expected[:5] and out.finish_reason == FinishReason.LENGTH
    assert out.usage is not None and out.usage.completion_tokens == 5
    # 12 prompt tokens in a 20-token context: 8 tokens fit. A larger max_tokens is refused
    # (tests/test_bad_input.py) unless the engine is asked to lower it.
    llm = LLM(str(llama_dir), max_model_len=20, clamp_max_tokens=True)
    out = llm.generate([prompt], greedy(24), use_tqdm=False)[0]
    assert out.token_ids == expected[:8] and out.finish_reason == FinishReason.LENGTH
    # The longest prompt allowed leaves room for exactly one token.
    longest = random_prompts([19], VOCAB_SIZE, seed=24)[0]
    out = llm.generate([longest], greedy(24), use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == FinishReason.LENGTH


def test_logprobs_equal_transformers_log_softmax(llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    num_top = 5
    prompts = random_prompts([9, 30], VOCAB_SIZE, seed=21)
    llm = LLM(str(llama_dir))
    sampling = SamplingParams(temperature=0, max_tokens=8, logprobs=num_top, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 :].float()  # [8, V]
        reference = torch.log_softmax(logits, dim=-1)
        assert len(out.logprobs) == len(out.token_ids) == 8
        for position, (token_id, logprobs) in enumerate(
            zip(out.token_ids, out.logprobs, strict=True)
        ):
            assert logprobs is not None and logprobs.token_id == token_id
            expected = reference[position]
            assert logprobs.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
            top_values, top_ids = expected.topk(num_top)
            assert [t for t, _ in logprobs.top] == top_ids.tolist()
            assert [v for _, v in logprobs.top] == pytest.approx(top_values.tolist(), abs=1e-4)
            assert logprobs.top[0][0] == token_id  # greedy picks the most likely token


# -- introspection and request ids --------------------------------------------------------


def test_stats_track_queues_and_pages(llama_dir: Path) -> None:
    prompts = random_prompts([20, 40, 60], VOCAB_SIZE, seed=22)
    engine = make_engine(llama_dir, max_seqs=2, pa_block_size=16)
    total = engine.block_manager.num_blocks
    idle = engine.stats()
    assert (idle.num_running, idle.num_waiting, idle.num_pages_used) == (0, 0, 0)
    assert idle.num_pages_free == total
    driver = Driver(engine)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, greedy(10))
    driver.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (2, 1, 0)
    assert stats.num_pages_used == 2 + 3  # KV of 20 and 40 prompt tokens, pages of 16
    seen_waiting_drain = False
    while engine.has_unfinished_requests():
        driver.step()
        stats = engine.stats()
        assert stats.num_pages_used + stats.num_pages_free == total
        assert stats.num_running <= 2
        assert stats.num_running + stats.num_waiting == engine.scheduler.num_unfinished
        seen_waiting_drain |= stats.num_waiting == 0 and stats.num_running > 0
    assert seen_waiting_drain
    done = engine.stats()
    assert (done.num_running, done.num_waiting, done.num_pages_used) == (0, 0, 0)
    assert done.num_pages_free == total and done.num_preemptions == 0
    assert idle.num_steps == 0 and idle.step_time_s == 0.0
    assert done.num_steps == driver.num_steps and done.step_time_s > 0


def test_while_gpu_busy_runs_once_per_forward_before_its_tokens_exist(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, prefill_chunk=16, max_batched_tokens=16, max_seqs=4)
    prompt = random_prompts([40], VOCAB_SIZE, seed=24)[0]  # three prefill chunks, then decode
    engine.add_request("r", prompt_token_ids=prompt, sampling=greedy(4))
    seen: list[tuple[int, int]] = []  # (computed tokens, output tokens) when called

    def while_gpu_busy() -> None:
        seq = engine.sequence("r")
        assert seq is not None
        seen.append((seq.num_computed_tokens, seq.num_output_tokens))

    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step(while_gpu_busy=while_gpu_busy)
        num_steps += 1
        assert len(seen) == num_steps  # every one of these steps ran a forward
    # called before the step's bookkeeping: no chunk or token of that step is visible yet
    assert seen == [(0, 0), (16, 0), (32, 0), (40, 1), (41, 2), (42, 3)]
    engine.add_request("gone", prompt_token_ids=prompt, sampling=greedy(4))
    engine.abort("gone")
    engine.step(while_gpu_busy=while_gpu_busy)  # only the abort: nothing runs, no call
    assert len(seen) == num_steps


def test_duplicate_in_flight_request_id_is_refused_until_it_finishes(llama_dir: Path) -> None:
    prompts = random_prompts([10, 14], VOCAB_SIZE, seed=23)
    expected = hf_greedy(llama_dir, prompts, 6)
    driver = Driver(make_engine(llama_dir))
    driver.add("dup", prompts[0], greedy(6))
    with pytest.raises(InvalidRequestError, match="dup") as queued:
        driver.engine.add_request("dup", prompt_token_ids=prompts[1], sampling=greedy(6))
    driver.step()
    with pytest.raises(InvalidRequestError, match="dup") as running:
        driver.engine.add_request("dup", prompt_token_ids=prompts[1], sampling=greedy(6))
    assert queued.value.field == running.value.field == "request_id"
    driver.run()
    assert driver.tokens(["dup"]) == expected[:1]

    driver.add("dup", prompts[1], greedy(6))  # finished: the id is free again
    driver.run()
    assert driver.tokens(["dup"]) == expected[1:]
    driver.add("dup", prompts[0], greedy(6))
    driver.step()
    driver.engine.abort("dup")
    driver.step()
    driver.add("dup", prompts[0], greedy(6))  # an aborted id is free again too
    driver.run()
    assert driver.tokens(["dup"]) == expected[:1]


def test_a_call_with_a_bad_request_runs_none_and_leaves_the_llm_usable(llama_dir: Path) -> None:
    """The request past the context is found only when the engine takes it: the requests
    taken before it are taken back, and the next call runs as on a fresh engine."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=64)
    prompt = random_prompts([8], VOCAB_SIZE, seed=3)[0]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    for bad in (SamplingParams(max_tokens=1000), SamplingParams(n=1000)):
        with pytest.raises(InvalidRequestError, match="request 1"):
            llm.generate([prompt, prompt], [greedy, bad], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    again = llm.generate([prompt], greedy, use_tqdm=False)
    fresh = LLM(str(llama_dir), device="cpu", max_model_len=64).generate(
        [prompt], greedy, use_tqdm=False
    )
    assert again[0].token_ids == fresh[0].token_ids and len(again[0].token_ids) == 4
