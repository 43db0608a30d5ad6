"""bench/samples.py on the CPU: n samples of one prompt prefill it once, n separate requests
of other prompts do not share the first run's cache, and greedy samples equal one request."""

from __future__ import annotations

from bench.samples import run_samples
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def test_n_samples_prefill_each_prompt_once_and_the_runs_share_no_cache() -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", max_model_len=256, pa_block_size=16))
    record = run_samples(engine, num_prompts=3, input_len=40, output_len=4, n=3)
    assert record["greedy_samples_equal_one_request"] is True
    together, separate = record["n_per_request"], record["separate_requests"]
    assert together["prefill_tokens"] == 3 * 40  # once per prompt, not per sample
    assert together["output_tokens"] == separate["output_tokens"] == 3 * 3 * 4
    # the separate run's prompts are new: at least one full prefill each
    assert separate["prefill_tokens"] >= 3 * 40
