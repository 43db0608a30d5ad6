"""``pagestream bench matrix``: a workload matrix on several models, pagestream against a peer
(vLLM) in the same machine session, into one record per card.

Per model, the peer runs first, on an empty GPU, in its own process, loaded once for all of
that model's workloads; then the engine, loaded once for all of them. Every result lands in
the record file the moment it is measured (``bench/matrix_record.py``), so a call that times
out loses only the workload it was in, and ``--resume`` runs only the sides still missing:
the matrix can be split over several calls on one machine.

A workload longer than a model's context runs on the model's long-context sibling of the
same layer shapes (``dummy:llama3-8b``, 8k, takes ``long-context`` on ``dummy:llama3.1-8b``,
128k with llama3 rope scaling), on both engines; the row says what ran (``run_as``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.matrix_engine import engine_info, engine_results
from bench.matrix_record import (
    ENGINE,
    FIGURE_SUFFIX,
    add_result,
    load_for_resume,
    new_record,
    pending,
    save_record,
)
from bench.matrix_workloads import MatrixWorkload
from bench.peer_process import run_peer_module
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from engine.loader.dummy import DUMMY_PREFIX, DUMMY_SHAPES
from engine.memory import release_device_memory

PEERS = ("vllm", "self")
DEFAULT_MODELS = ("dummy:qwen3-0.6b", "dummy:llama3-8b")  # as --models spells them
LONG_CONTEXT_SHAPES = {"llama3-8b": "llama3.1-8b"}  # same layers, a 128k context


@dataclass(frozen=True)
class ModelGroup:
    """Workloads that run on one load of one model (per engine)."""

    label: str  # the rows' "model"
    model: str  # what both engines load
    workloads: tuple[MatrixWorkload, ...]


def model_name(text: str) -> str:
    """A bare dummy shape (``qwen3-0.6b``) means ``dummy:qwen3-0.6b``; anything else as given."""
    return DUMMY_PREFIX + text if text in DUMMY_SHAPES else text


def model_label(name: str) -> str:
    return name.removeprefix(DUMMY_PREFIX) if name.startswith(DUMMY_PREFIX) else Path(name).name


def model_context_len(name: str) -> int | None:
    """The model's own context (``max_position_embeddings``), where it can be read unloaded."""
    if name.startswith(DUMMY_PREFIX):
        shape = DUMMY_SHAPES.get(name.removeprefix(DUMMY_PREFIX))
        return None if shape is None else int(shape["max_position_embeddings"])
    config = Path(name) / "config.json"
    if config.is_file():
        fields = json.loads(config.read_text())
        value = fields.get("max_position_embeddings") or fields.get("text_config", {}).get(
            "max_position_embeddings"
        )
        return int(value) if value else None
    return None  # a hub id or a GGUF: the engine checks when it loads


def plan_groups(
    models: list[str], workloads: list[MatrixWorkload], config: EngineConfig
) -> list[ModelGroup]:
    """Each model's workloads, those too long for it moved to its long-context sibling."""
    groups = []
    for name in models:
        fits, longer = _split_by_context(name, workloads, config)
        if fits:
            groups.append(ModelGroup(model_label(name), name, tuple(fits)))
        if not longer:
            continue
        sibling = LONG_CONTEXT_SHAPES.get(model_label(name))
        sibling_name = None if sibling is None else DUMMY_PREFIX + sibling
        if sibling_name is None or not name.startswith(DUMMY_PREFIX):
            _refuse_too_long(name, longer, config)
        assert sibling_name is not None
        still_longer = _split_by_context(sibling_name, longer, config)[1]
        if still_longer:
            _refuse_too_long(sibling_name, still_longer, config)
        groups.append(ModelGroup(model_label(name), sibling_name, tuple(longer)))
    return groups


def _context_len(name: str, config: EngineConfig) -> int | None:
    own = model_context_len(name)
    if config.max_model_len is None:
        return own
    return config.max_model_len if own is None else min(own, config.max_model_len)


def _split_by_context(
    name: str, workloads: list[MatrixWorkload], config: EngineConfig
) -> tuple[list[MatrixWorkload], list[MatrixWorkload]]:
    context = _context_len(name, config)
    fits = [w for w in workloads if context is None or w.longest_request_len <= context]
    return fits, [w for w in workloads if w not in fits]


def _refuse_too_long(name: str, workloads: list[MatrixWorkload], config: EngineConfig) -> None:
    needs = ", ".join(f"{w.name} needs {w.longest_request_len} tokens" for w in workloads)
    raise ConfigError(
        f"{needs}; {name}'s context is {_context_len(name, config)} tokens: leave them out "
        "(--workloads), raise --max-model-len, or choose a model with a longer context"
    )


def run_matrix(
    config: EngineConfig,
    groups: list[ModelGroup],
    *,
    peer: str | None,
    scale: float,
    path: Path,
    resume: bool,
    use_tqdm: bool = True,
    profile_every: int = 0,
) -> dict[str, Any]:
    """Run every missing side of every row of ``groups``; the record, saved after each.

    ``profile_every``: both sides profile about one step in that many of each throughput row
    (``bench/kernel_sample.py``): the rows then say where the kernel time goes, and their
    figures are a profiled run's."""
    if path.exists() and not resume:
        raise ConfigError(
            f"{path} exists: pass --resume to add to it, or another --output-json to start anew"
        )
    record = (
        load_for_resume(path, config, peer, scale, profile_every)
        if path.exists()
        else new_record(config, peer, scale, profile_every)
    )
    sides = [*([peer] if peer else []), ENGINE]  # the peer first, on an empty GPU
    todo = [
        (group, side, pending(record, group.label, side, list(group.workloads)))
        for group in groups
        for side in sides
    ]
    progress = _Progress(sum(len(w) for _, _, w in todo), use_tqdm)
    try:
        for group, side, workloads in todo:
            if not workloads:
                continue
            progress.starting(side, group.label)
            group_config = dataclasses.replace(config, model=group.model)
            if side == ENGINE:
                _run_engine(
                    record, path, group, group_config, workloads, progress, use_tqdm, profile_every
                )
            else:
                _run_peer(
                    record, path, group, group_config, workloads, side, scale, progress,
                    profile_every,
                )  # fmt: skip
            _plot(record, path)
    finally:
        progress.close()
    return record


def _run_engine(
    record: dict[str, Any],
    path: Path,
    group: ModelGroup,
    config: EngineConfig,
    workloads: list[MatrixWorkload],
    progress: _Progress,
    use_tqdm: bool,
    profile_every: int,
) -> None:
    engine = LLMEngine(config)
    try:
        record["engines"][group.model] = engine_info(engine)
        results = engine_results(engine, workloads, use_tqdm=use_tqdm, profile_every=profile_every)
        for workload, result in results:
            row = add_result(record, group.label, group.model, workload, ENGINE, result)
            save_record(record, path)
            progress.done(ENGINE, row)
    finally:
        engine.shutdown()
        del engine
        release_device_memory()


def _run_peer(
    record: dict[str, Any],
    path: Path,
    group: ModelGroup,
    config: EngineConfig,
    workloads: list[MatrixWorkload],
    peer: str,
    scale: float,
    progress: _Progress,
    profile_every: int,
) -> None:
    """The peer in its own process; each result saved as the child reports it."""
    by_name = {w.name: w for w in workloads}
    num_saved = 0

    def on_record(peer_record: dict[str, Any]) -> None:
        nonlocal num_saved
        record["peers"][group.model] = {k: v for k, v in peer_record.items() if k != "results"}
        for result in peer_record["results"][num_saved:]:
            workload = by_name[result["workload"]]
            fields = {k: v for k, v in result.items() if k != "workload"}
            row = add_result(record, group.label, group.model, workload, peer, fields)
            progress.done(peer, row)
        num_saved = len(peer_record["results"])
        save_record(record, path)

    if peer == "vllm":
        from bench.vllm_peer import matrix_peer_args, run_vllm_peer

        peer_args = matrix_peer_args(config, workloads, scale, profile_every)
        run_vllm_peer("matrix", peer_args, on_record)
    else:
        arguments = [
            "--config-json", json.dumps(dataclasses.asdict(config)),
            "--workloads", ",".join(by_name), "--scale", repr(scale),
            "--profile-every", str(profile_every),
        ]  # fmt: skip
        run_peer_module("bench.matrix_engine", arguments, name="self", on_record=on_record)


class _Progress:
    """The matrix's bar (its ETA) and one line per result, so that a device call's log shows
    what finished even with --no-progress."""

    def __init__(self, total: int, use_tqdm: bool) -> None:
        self.bar = tqdm(total=total, desc="matrix", unit="run", disable=not use_tqdm)
        self.total, self.num_done, self.start_s = total, 0, time.monotonic()

    def starting(self, side: str, label: str) -> None:
        self.bar.set_description(f"matrix: {side} {label}")

    def done(self, side: str, row: dict[str, Any]) -> None:
        self.bar.update()
        self.num_done += 1
        figure = row[f"{side}_{FIGURE_SUFFIX[row['metric']]}"]
        text = (
            f"{figure * 1e3:.2f} ms TPOT" if row["metric"] == "tpot_s" else f"{figure:,.0f} tok/s"
        )
        ratio = f", ratio {row['ratio']:.3f}" if "ratio" in row else ""
        elapsed = time.strftime("%M:%S", time.gmtime(time.monotonic() - self.start_s))
        tqdm.write(
            f"[matrix {self.num_done}/{self.total} {elapsed}] {side} {row['model']} "
            f"{row['workload']}: {text}{ratio}",
            file=sys.stderr,
        )

    def close(self) -> None:
        self.bar.close()


def _plot(record: dict[str, Any], path: Path) -> None:
    from bench.plots import plot_record

    plot_record(record, path.with_suffix(".png"))
