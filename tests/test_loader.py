"""Model names resolve to the right source; hub ids go through huggingface_hub."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.attention.backend import TorchAttentionBackend
from engine.errors import ModelLoadError
from engine.loader import load_model, resolve_model_dir


def test_hub_id_is_fetched_through_snapshot_download(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    asked: list[str] = []

    def fake_snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        asked.append(repo_id)
        assert "*.safetensors" in allow_patterns and "*.json" in allow_patterns
        return str(tiny_model_dirs["qwen2"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("Qwen/Qwen2-tiny") == tiny_model_dirs["qwen2"]
    assert asked == ["Qwen/Qwen2-tiny"]


def test_unreachable_hub_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="could not fetch 'no-such-org/no-such-model'"):
        resolve_model_dir("no-such-org/no-such-model")


def test_eos_ids_come_from_config_and_generation_config(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "with-gen-config"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"eos_token_id": 11}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    loaded = load_model(str(model_dir), torch.float32, torch.device("cpu"), TorchAttentionBackend())
    assert loaded.eos_token_ids == {2, 7, 9, 11}
    assert loaded.tokenizer is None  # the tiny model has no tokenizer files


def test_checkpoint_missing_a_weight_is_refused(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "partial"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    weights_file = next(model_dir.glob("*.safetensors"))
    weights = load_file(weights_file)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(str(model_dir), torch.float32, torch.device("cpu"), TorchAttentionBackend())


def test_logits_into_a_callers_buffer_equal_the_plain_ones(
    tiny_model_dirs: dict[str, Path],
) -> None:
    # the CUDA graphs write every bucket's logits into one static buffer this way
    model = load_model(
        str(tiny_model_dirs["qwen2"]), torch.float32, torch.device("cpu"), TorchAttentionBackend()
    ).model
    hidden = torch.randn(5, model.arch.hidden_size)
    buffer = torch.full((8, model.arch.vocab_size), float("nan"))
    out = model.compute_logits(hidden, out=buffer[:5])
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:5], model.compute_logits(hidden))


@pytest.mark.parametrize("name", ["dummy:tiny", "dummy:tiny-moe"])
def test_weights_are_allocated_once_in_the_load_dtype(name: str) -> None:
    """A bf16 model's parameters are made in bf16: no float32 copy of the weights first,
    which would need twice the memory (a 30B MoE model would not fit one 80 GB GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes_by_dtype: dict[torch.dtype, int] = {}
            ops = torch.ops.aten
            self.factories = (ops.empty, ops.empty_like, ops.empty_strided)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in self.factories and out.device.type == "cpu":
                size = out.numel() * out.element_size()
                self.bytes_by_dtype[out.dtype] = self.bytes_by_dtype.get(out.dtype, 0) + size
            return out

    with Allocations() as allocations:
        loaded = load_model(name, torch.bfloat16, torch.device("cpu"), TorchAttentionBackend())
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert allocations.bytes_by_dtype.get(torch.bfloat16, 0) >= params
    # float32 allocations: the rotary tables and the like, never the weights' size
    assert allocations.bytes_by_dtype.get(torch.float32, 0) < params / 2
