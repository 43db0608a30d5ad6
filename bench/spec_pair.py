"""A target model grown from a draft model: the pair that draft-model speculation needs.

``--speculative-model`` pays when the draft is much cheaper than the target and predicts it
well. No such pair of one tokenizer can be had offline (the one trained checkpoint here is
the bundled 135M model), so this builds one: a Llama target the size of an 8B model whose
function is the draft's, plus a perturbation of a chosen size.

Growing keeps the draft inside the target exactly:

* the hidden size, the heads, the MLP width and the layers grow by appended units; the
  draft's weights fill the top-left corner of each matrix, and the residual stream's new
  dimensions stay zero (the embedding and every output projection write nothing there);
* RMSNorm averages over the larger hidden size, so its weights shrink by ``sqrt(H / H')``
  and its epsilon by ``H / H'``: on the draft's dimensions it gives the draft's values;
* new attention heads keep the draft's queries per KV head, so the draft's heads still read
  the draft's KV heads; new layers come after the draft's.

The new units get random weights, so the target does a full-size model's work. What they
write into the draft's dimensions (new heads' columns of o_proj, new channels' columns of
down_proj, whole new layers) is scaled by ``noise``, relative to the draft's own weights of
that projection: 0 makes the target compute the draft's function (every greedy draft holds,
up to rounding), larger values make the two disagree more often. The acceptance rate that
results is measured by ``pagestream bench speculative``, not assumed here.

    python -m bench.spec_pair smollm2-135m /tmp/grown --noise 0.1
    pagestream bench speculative --model /tmp/grown --speculative-model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.errors import ModelLoadError

GROWABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
SHARD_BYTES = 4 << 30
# the size of llama3-8b's layers: hidden about 4,096 (whole groups of the draft's heads)
DEFAULT_HIDDEN = 4096
DEFAULT_INTERMEDIATE = 14336
DEFAULT_LAYERS = 32


@dataclass(frozen=True)
class DraftShape:
    """The draft's sizes, read from its config."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    tied: bool

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class GrownShape:
    heads: int
    intermediate: int
    layers: int


def read_draft(config: dict[str, Any]) -> DraftShape:
    """The draft's sizes; a clear error for a model this cannot grow."""
    architectures = config.get("architectures") or []
    if not set(architectures) & set(GROWABLE_ARCHITECTURES):
        raise ModelLoadError(
            f"spec_pair grows {', '.join(GROWABLE_ARCHITECTURES)} drafts, not {architectures}"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ModelLoadError("spec_pair: a draft with biases cannot be grown")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return DraftShape(
        hidden=config["hidden_size"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        tied=bool(config.get("tie_word_embeddings", False)),
    )


def grown_shape(
    draft: DraftShape,
    heads: int | None = None,
    intermediate: int | None = None,
    layers: int | None = None,
) -> GrownShape:
    """The sizes asked for, the others as large as llama3-8b's: whole groups of heads up to a
    4,096 hidden size, its MLP width and layer count (never smaller than the draft's)."""
    groups = max(DEFAULT_HIDDEN // draft.head_dim // draft.group, draft.kv_heads)
    return GrownShape(
        heads=heads or groups * draft.group,
        intermediate=intermediate or max(DEFAULT_INTERMEDIATE, draft.intermediate),
        layers=layers or max(DEFAULT_LAYERS, draft.layers),
    )


def check_grown_shape(draft: DraftShape, grown: GrownShape) -> None:
    if grown.heads < draft.heads or grown.heads % draft.group:
        raise ModelLoadError(
            f"spec_pair: {grown.heads} heads must be at least the draft's {draft.heads} and a "
            f"multiple of its {draft.group} queries per KV head"
        )
    if grown.intermediate < draft.intermediate or grown.layers < draft.layers:
        raise ModelLoadError(
            f"spec_pair: the MLP width ({grown.intermediate}) and layers ({grown.layers}) "
            f"cannot be smaller than the draft's ({draft.intermediate}, {draft.layers})"
        )


class _Grower:
    """Makes the grown model's tensors one at a time, on ``device``, in float32."""

    def __init__(
        self,
        draft: DraftShape,
        grown: GrownShape,
        weights: dict[str, torch.Tensor],
        noise: float,
        seed: int,
        device: torch.device,
    ) -> None:
        self.draft, self.grown, self.weights, self.noise = draft, grown, weights, noise
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.hidden = grown.heads * draft.head_dim
        self.kv_heads = grown.heads // draft.group
        # RMSNorm over H' dimensions of which H carry the stream: w * sqrt(H / H')
        self.norm_scale = math.sqrt(draft.hidden / self.hidden)

    def _draft(self, name: str) -> torch.Tensor:
        return self.weights[name].to(self.device, torch.float32)

    def _random(self, rows: int, cols: int, std: float) -> torch.Tensor:
        out = torch.empty(rows, cols, device=self.device)
        return out.normal_(0.0, std, generator=self.generator)

    def _input_projection(self, draft: torch.Tensor | None, rows: int) -> torch.Tensor:
        """q/k/v/gate/up ``[rows, H']``: the draft's block, random rows for new units (they
        read only the stream's draft dimensions: the others are zero)."""
        out = torch.zeros(rows, self.hidden, device=self.device)
        h = self.draft.hidden
        out[:, :h] = self._random(rows, h, 1.0 / math.sqrt(h))
        if draft is not None:
            out[: draft.shape[0], :h] = draft
        return out

    def _output_projection(
        self, draft: torch.Tensor | None, reference: torch.Tensor, cols: int
    ) -> torch.Tensor:
        """o/down ``[H', cols]``: the draft's block, new columns writing ``noise`` into the
        draft's dimensions (scaled so that all new columns together write about ``noise``
        times what the draft's do), nothing into the new dimensions."""
        out = torch.zeros(self.hidden, cols, device=self.device)
        h, draft_cols = self.draft.hidden, reference.shape[1]
        first_new = 0 if draft is None else draft.shape[1]
        if self.noise and cols > first_new:
            rms = reference.pow(2).mean().sqrt().item()
            std = self.noise * rms * math.sqrt(draft_cols / (cols - first_new))
            out[:h, first_new:] = self._random(h, cols - first_new, std)
        if draft is not None:
            out[:h, :first_new] = draft
        return out

    def _norm(self, draft: torch.Tensor | None) -> torch.Tensor:
        out = torch.full((self.hidden,), self.norm_scale, device=self.device)
        if draft is not None:
            out[: self.draft.hidden] = draft * self.norm_scale
        return out

    def _stream_rows(self, draft: torch.Tensor) -> torch.Tensor:
        """embed / lm_head ``[V, H']``: zero beyond the draft's dimensions."""
        out = torch.zeros(draft.shape[0], self.hidden, device=self.device)
        out[:, : self.draft.hidden] = draft
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        draft, grown = self.draft, self.grown
        d = draft.head_dim
        embed = self._draft("model.embed_tokens.weight")
        yield "model.embed_tokens.weight", self._stream_rows(embed)
        last = f"model.layers.{draft.layers - 1}"
        for layer in range(grown.layers):
            src = f"model.layers.{layer}" if layer < draft.layers else None
            dst = f"model.layers.{layer}"

            def w(name: str, src: str | None = src) -> torch.Tensor | None:
                return None if src is None else self._draft(f"{src}.{name}.weight")

            for norm in ("input_layernorm", "post_attention_layernorm"):
                yield f"{dst}.{norm}.weight", self._norm(w(norm))
            for proj, heads in (("q", grown.heads), ("k", self.kv_heads), ("v", self.kv_heads)):
                name = f"self_attn.{proj}_proj"
                yield f"{dst}.{name}.weight", self._input_projection(w(name), heads * d)
            o_ref = self._draft(f"{src or last}.self_attn.o_proj.weight")
            yield (
                f"{dst}.self_attn.o_proj.weight",
                self._output_projection(w("self_attn.o_proj"), o_ref, grown.heads * d),
            )
            for proj in ("gate", "up"):
                name = f"mlp.{proj}_proj"
                yield f"{dst}.{name}.weight", self._input_projection(w(name), grown.intermediate)
            down_ref = self._draft(f"{src or last}.mlp.down_proj.weight")
            yield (
                f"{dst}.mlp.down_proj.weight",
                self._output_projection(w("mlp.down_proj"), down_ref, grown.intermediate),
            )
        yield "model.norm.weight", self._norm(self._draft("model.norm.weight"))
        if not draft.tied:
            yield "lm_head.weight", self._stream_rows(self._draft("lm_head.weight"))

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        return {
            **base,
            "hidden_size": self.hidden,
            "num_attention_heads": self.grown.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.draft.head_dim,
            "intermediate_size": self.grown.intermediate,
            "num_hidden_layers": self.grown.layers,
            "rms_norm_eps": base.get("rms_norm_eps", 1e-6) * self.draft.hidden / self.hidden,
        }


def grow_target(
    draft_name: str,
    out_dir: Path,
    *,
    heads: int | None = None,
    intermediate: int | None = None,
    layers: int | None = None,
    noise: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    shard_bytes: int = SHARD_BYTES,
    use_tqdm: bool = True,
) -> Path:
    """Write the grown target of ``draft_name`` (anything ``--model`` takes but ``dummy:``)
    into ``out_dir`` as a Hugging Face directory: config, sharded safetensors with their
    index, and the draft's tokenizer files. Sizes not given: ``grown_shape``'s."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.loader import resolve_model_dir

    if noise < 0:
        raise ModelLoadError(f"spec_pair: noise must be >= 0, got {noise}")
    draft_dir = resolve_model_dir(draft_name)
    base = json.loads((draft_dir / "config.json").read_text())
    draft = read_draft(base)
    grown = grown_shape(draft, heads, intermediate, layers)
    check_grown_shape(draft, grown)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                weights[key] = handle.get_tensor(key)
    grower = _Grower(draft, grown, weights, noise, seed, torch.device(device))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.safetensors"):
        stale.unlink()
    for file in draft_dir.iterdir():
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name[0] != ".":
            shutil.copy(file, out_dir / file.name)
    config = grower.config(base)
    config["dtype" if "dtype" in base else "torch_dtype"] = str(dtype).removeprefix("torch.")
    config["pagestream_grown_from"] = {"draft": draft_name, "noise": noise, "seed": seed}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    num_tensors = 2 + grown.layers * 9 + (0 if draft.tied else 1)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_size = total_size = 0

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_size = {}, 0

    for name, tensor in tqdm(
        grower.tensors(), total=num_tensors, desc="grow", unit="tensor", disable=not use_tqdm
    ):
        shard[name] = tensor.to(dtype).cpu().contiguous()
        size = shard[name].numel() * shard[name].element_size()
        shard_size, total_size = shard_size + size, total_size + size
        if shard_size >= shard_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m bench.spec_pair",
        description="Grow a target model around a draft model (see the module's docstring).",
    )
    parser.add_argument("draft", help="the draft: an HF directory, a .gguf, or smollm2-135m")
    parser.add_argument("out", type=Path, help="directory to write the grown target into")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="what new units write into the draft's dimensions, relative to "
                             "the draft's own weights (0: the draft's function)")  # fmt: skip
    parser.add_argument("--heads", type=int, help="attention heads (default: hidden ~4,096)")
    parser.add_argument("--intermediate-size", type=int, help="MLP width (default 14,336)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = grow_target(
            args.draft, args.out, heads=args.heads, intermediate=args.intermediate_size,
            layers=args.layers, noise=args.noise, seed=args.seed,
            dtype=getattr(torch, args.dtype), device=args.device,
        )  # fmt: skip
    except ModelLoadError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"grown target written to {out}")


if __name__ == "__main__":
    main()
