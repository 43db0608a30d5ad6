"""Python garbage-collector pauses during generation, with the engine's objects frozen
(``engine.memory.gc_frozen``, the default of every serving loop) and without.

``python -m bench.gc_pauses --model dummy:tiny --out bench/results/gc-pauses-tiny-cpu.json``
runs ``LLM.generate`` on ``--num-prompts`` prompts of ``--output-len`` tokens each way, and
records every collection's pause by generation (``gc.callbacks``): the number, the total and
the longest, with the objects the collector tracked when the run began. A whole run first
takes the first generation's one-time costs (it ran 1.7x slower than the next, frozen or not).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

from bench.records import machine_info, save, utc_now
from engine import LLM, SamplingParams
from engine.memory import GC_FREEZE_ENV

GENERATIONS = (0, 1, 2)


class PauseLog:
    """Each collection's pause, by generation, while attached (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses_s: dict[int, list[float]] = {generation: [] for generation in GENERATIONS}
        self._start_s = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start_s = time.perf_counter()
        else:
            self.pauses_s[info["generation"]].append(time.perf_counter() - self._start_s)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{generation}": {
                "collections": len(pauses),
                "total_ms": sum(pauses) * 1e3,
                "max_ms": max(pauses, default=0.0) * 1e3,
            }
            for generation, pauses in self.pauses_s.items()
        }


def run_once(llm: LLM, num_prompts: int, output_len: int, frozen: bool) -> dict[str, Any]:
    """One generation with the freeze on or off: its pauses and its time."""
    os.environ[GC_FREEZE_ENV] = "1" if frozen else "0"
    if not frozen:
        gc.unfreeze()  # none frozen means none: importing torch 2.11 on a GPU host froze 375
    gc.collect()
    tracked = len(gc.get_objects())
    log = PauseLog()
    gc.callbacks.append(log)
    sampling = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start_s = time.perf_counter()
    try:
        llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * num_prompts, sampling, use_tqdm=False)
    finally:
        gc.callbacks.remove(log)
    return {
        "frozen": frozen,
        "tracked_objects": tracked,
        "elapsed_s": time.perf_counter() - start_s,
        "pauses": log.summary(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="dummy:tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = parser.parse_args(argv)
    previous = os.environ.get(GC_FREEZE_ENV)
    llm = LLM(args.model, device=args.device, max_seqs=args.num_prompts,
              max_model_len=args.output_len + 16)  # fmt: skip
    try:  # a whole run first: the first one's costs (memory first touched) land in neither row
        run_once(llm, args.num_prompts, args.output_len, frozen=False)
        results = [
            run_once(llm, args.num_prompts, args.output_len, frozen) for frozen in (False, True)
        ]
    finally:
        if previous is None:
            os.environ.pop(GC_FREEZE_ENV, None)
        else:
            os.environ[GC_FREEZE_ENV] = previous
    for row in results:
        gen2 = row["pauses"]["gen2"]
        print(f"frozen={row['frozen']}: {row['elapsed_s']:.1f} s, full collections "
              f"{gen2['collections']}, {gen2['total_ms']:.0f} ms in all, longest "
              f"{gen2['max_ms']:.1f} ms")  # fmt: skip
    record = {
        "kind": "gc-pauses",
        "created_utc": utc_now(),
        "machine": machine_info(args.device),
        "settings": {
            "model": args.model,
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
        },
        "results": results,
    }
    save(record, str(args.out) if args.out else None)


if __name__ == "__main__":
    main()
