"""bench.quant on a tiny dummy model (CPU): the record holds every format's figures."""

from __future__ import annotations

import pytest

from bench.quant import measure_quant
from tests.test_cli import run_cli


def test_quant_record_compares_each_format_with_the_float_model() -> None:
    record = measure_quant(
        "dummy:tiny", ["q8_0", "q4_0"], num_prompts=2, input_len=12, output_len=6,
        throughput=None, max_model_len=128, pa_memory_mb=16,
    )  # fmt: skip
    results = record["results"]
    assert record["kind"] == "quant" and set(results) == {"none", "q8_0", "q4_0"}
    assert results["none"]["linear_formats"] == []
    assert results["q4_0"]["linear_formats"] == ["q4_0", "q8_0"]  # the LM head stays 8-bit
    weights = {name: result["weights_bytes"] for name, result in results.items()}
    assert weights["q4_0"] < weights["q8_0"] < weights["none"]
    for name in ("q8_0", "q4_0"):
        assert 0 < results[name]["logit_max_abs_error"] < 1
        batch_1 = results[name]["batch1"]
        assert batch_1["mean_tpot_s"] > 0
        # tiny's embedding is untied: a decode step reads one row of it, not all
        embedding_bytes = 512 * 64 * 4
        assert batch_1["streamed_step_bytes"] == batch_1["decode_step_bytes"] - embedding_bytes
        assert "throughput" not in results[name]  # (bench throughput's own tests cover it)
    assert results["q8_0"]["logit_mean_abs_error"] < results["q4_0"]["logit_mean_abs_error"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--num-prompts", "0"), ("--output-len", "0"), ("--input-len", "-1"),
     ("--throughput-prompts", "-2"), ("--max-model-len", "0")],
)  # fmt: skip
def test_counts_out_of_range_are_usage_errors_before_any_model_loads(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a model that cannot load: had the flag passed, the error would be the model's
    args = ["bench", "quant", "--model", "dummy:no-such-shape", flag, value]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and f"argument {flag}: expected" in err
