"""bench/spec_pair.py: a target grown around a draft computes the draft's function (noise 0)
in a larger model, so draft-model speculation can be measured without a trained pair."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.spec_pair import grow_target, main
from engine import SamplingParams
from engine.errors import ModelLoadError
from tests.test_speculative import TIGHT, repetitive_prompts
from tests.test_speculative_draft_model import drafted_like_plain


def grow_tiny(draft: Path, out: Path, **settings: Any) -> Path:
    """The tiny llama (4 heads, MLP 128, 2 layers) grown to 8 heads, 192 and 3, in fp32."""
    return grow_target(
        str(draft), out, heads=8, intermediate=192, layers=3, dtype=torch.float32,
        use_tqdm=False, **settings,
    )  # fmt: skip


def logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def llama(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def grown(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grown")
    return grow_tiny(llama, out, shard_bytes=200_000)


def test_the_grown_model_has_the_shape_asked_for_in_shards(llama: Path, grown: Path) -> None:
    config = json.loads((grown / "config.json").read_text())
    base = json.loads((llama / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"]) == (128, 8)
    assert (config["num_key_value_heads"], config["head_dim"]) == (4, 16)  # 2 queries a KV head
    assert (config["intermediate_size"], config["num_hidden_layers"]) == (192, 3)
    assert config["rms_norm_eps"] == pytest.approx(base["rms_norm_eps"] / 2)
    index = json.loads((grown / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((grown / name).is_file() for name in shards)
    assert len(index["weight_map"]) == 2 + 3 * 9 + 1  # the tiny llama's head is untied


def test_without_noise_the_grown_model_computes_the_drafts_logits(llama: Path, grown: Path) -> None:
    ids = torch.randint(3, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    small, large = logits(llama, ids), logits(grown, ids)
    torch.testing.assert_close(large, small, atol=2e-5, rtol=1e-5)


def test_noise_makes_the_two_disagree_more_as_it_grows(llama: Path, tmp_path: Path) -> None:
    ids = torch.randint(3, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    small = logits(llama, ids)
    errors = []
    for noise in (0.05, 0.5):
        out = grow_tiny(llama, tmp_path / str(noise), noise=noise)
        errors.append((logits(out, ids) - small).abs().max().item())
    assert 1e-3 < errors[0] < errors[1]


def test_the_draft_has_every_greedy_draft_accepted_by_its_grown_target(
    llama: Path, grown: Path
) -> None:
    """Through the engine (its own model code, pools and verifier), with preemption."""
    prompts = repetitive_prompts(4, seed=41)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 4
    _, engine = drafted_like_plain(grown, llama, prompts, params, 4, **TIGHT)
    stats = engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_that_cannot_be_grown_is_refused(
    tiny_model_dirs: dict[str, Path], llama: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="not \\['Qwen2ForCausalLM'\\]"):
        grow_target(str(tiny_model_dirs["qwen2"]), tmp_path / "q", use_tqdm=False)
    with pytest.raises(ModelLoadError, match="multiple of its 2 queries per KV head"):
        grow_target(str(llama), tmp_path / "h", heads=7, intermediate=192, layers=3, use_tqdm=False)
    with pytest.raises(ModelLoadError, match="cannot be smaller"):
        grow_target(str(llama), tmp_path / "l", heads=8, intermediate=192, layers=1, use_tqdm=False)
    with pytest.raises(ModelLoadError, match="noise must be >= 0"):
        grow_target(str(llama), tmp_path / "n", noise=-1.0, use_tqdm=False)


def test_the_command_line_writes_a_loadable_model(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(llama), str(tmp_path / "cli"), "--heads", "8", "--intermediate-size", "192",
            "--layers", "2", "--noise", "0.1", "--device", "cpu"]  # fmt: skip
    main(argv)
    assert "grown target written to" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["pagestream_grown_from"] == {"draft": str(llama), "noise": 0.1, "seed": 0}
    ids = torch.arange(3, 19)[None]
    assert logits(tmp_path / "cli", ids).shape == (1, 16, 320)
    with pytest.raises(SystemExit, match="error: spec_pair: 7 heads"):
        main([str(llama), str(tmp_path / "bad"), "--heads", "7"])
