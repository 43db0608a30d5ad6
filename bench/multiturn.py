"""Multi-turn chat benchmark: many sessions share a long system prompt and come back for
several turns, with the prefix cache's host tier (``--kv-offload-mb``) off and then on.

Each turn's prompt is the system prompt, the session's history (its earlier user turns and
the engine's own replies to them) and a new user turn, all random token ids (so
``dummy:<shape>`` models work); replies are greedy with EOS ignored, so every reply has the
same length in both runs. Up to ``concurrency`` sessions are in flight; a session whose
reply lands goes to the back of the line for its next turn, so ``num_sessions`` requests
pass between two turns of one session. When the GPU pool cannot hold every session's history
for that long, the host tier is what saves recomputing it.

The record has, per run, TTFT percentiles (all turns, and turns after the first), output and
total tokens/s, and the prompt tokens each cache tier served.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from bench.records import machine_info, percentiles
from bench.throughput import prefix_cache_counts, resolved_settings
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.llm_engine import EngineStats, LLMEngine
from engine.memory import release_device_memory
from engine.sampling_params import SamplingParams
from engine.sequence import Usage

WARMUP_TURNS = 2
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Sessions, turns, and token counts: one shared system prompt, per-turn user lengths
    drawn uniformly from ``user_len``, replies of ``output_len`` tokens."""

    num_sessions: int = 64
    num_turns: int = 4
    system_len: int = 1024
    user_len: tuple[int, int] = (32, 128)
    output_len: int = 64
    concurrency: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "system_len", "output_len", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not 1 <= self.user_len[0] <= self.user_len[1]:
            raise ConfigError("user_len must be a range MIN-MAX with 1 <= MIN <= MAX")

    @property
    def longest_tokens(self) -> int:
        """The last turn's prompt and reply at the longest user turns."""
        return self.system_len + self.num_turns * (self.user_len[1] + self.output_len)


@dataclass
class Session:
    """One chat: its user turns up front, its replies as they come."""

    user_turns: list[list[int]]
    history: list[int] = field(default_factory=list)  # user turns and replies so far
    num_done: int = 0

    def next_prompt(self, system: list[int]) -> list[int]:
        return system + self.history + self.user_turns[self.num_done]

    def add_reply(self, reply: list[int]) -> None:
        self.history += self.user_turns[self.num_done] + reply
        self.num_done += 1


def make_sessions(workload: MultiTurnWorkload, vocab_size: int) -> tuple[list[int], list[Session]]:
    """The system prompt and the sessions' user turns; the same lists for the same seed."""
    rng = np.random.default_rng(workload.seed)
    system = rng.integers(0, vocab_size, workload.system_len).tolist()
    low, high = workload.user_len
    sessions = [
        Session([
            rng.integers(0, vocab_size, int(rng.integers(low, high + 1))).tolist()
            for _ in range(workload.num_turns)
        ])
        for _ in range(workload.num_sessions)
    ]  # fmt: skip
    return system, sessions


def run_multiturn(
    config: EngineConfig, workload: MultiTurnWorkload, *, use_tqdm: bool = True
) -> dict[str, Any]:
    """Run the workload with the host tier off, then with ``config.kv_offload_mb``; the record."""
    if config.kv_offload_mb <= 0:
        raise ConfigError("give --kv-offload-mb N: the host tier to compare against none")
    created_utc = datetime.now(UTC)
    runs: dict[str, dict[str, Any]] = {}
    replies: dict[str, dict[str, list[int]]] = {}
    settings: dict[str, Any] = {}
    for name, offload_mb in (("offload_off", 0), ("offload_on", config.kv_offload_mb)):
        engine = LLMEngine(dataclasses.replace(config, kv_offload_mb=offload_mb))
        _check_fits(engine, workload)
        runs[name], replies[name] = _measure(engine, workload, use_tqdm, desc=name)
        settings = {**dataclasses.asdict(config), **dataclasses.asdict(workload),
                    "resolved": resolved_settings(engine)}  # fmt: skip
        engine.shutdown()  # its tensor-parallel ranks, if any
        del engine  # one model in memory at a time
        release_device_memory()
    off, on = runs["offload_off"], runs["offload_on"]
    return {
        "kind": "multiturn",
        "created_utc": created_utc.isoformat(timespec="seconds"),
        "machine": machine_info(config.resolved_device()),
        "settings": settings,
        "results": {
            **runs,
            "ttft_p50_ratio": _ratio(on["ttft_s"]["p50"], off["ttft_s"]["p50"]),
            "total_tok_s_ratio": _ratio(on["total_tok_s"], off["total_tok_s"]),
            # bf16 recomputation may round differently from the saved pages: count agreement
            "same_replies": _agreement(replies["offload_off"], replies["offload_on"]),
        },
    }


def _agreement(off: dict[str, list[int]], on: dict[str, list[int]]) -> float:
    """Share of turns whose reply is the same in both runs."""
    return sum(off[rid] == on.get(rid) for rid in off) / len(off)


def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def _check_fits(engine: LLMEngine, workload: MultiTurnWorkload) -> None:
    if workload.longest_tokens > engine.max_model_len:
        raise ConfigError(
            f"the last turn can reach {workload.longest_tokens} tokens, past the context of "
            f"{engine.max_model_len}: lower --system-len / --num-turns / --user-len / "
            "--output-len or raise --max-model-len"
        )


@dataclass
class _Tally:
    submitted_s: dict[str, float] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    replies: dict[str, list[int]] = field(default_factory=dict)  # request -> its reply
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class _Chats:
    """Drives every session of a workload through its turns, ``concurrency`` at a time."""

    def __init__(self, engine: LLMEngine, workload: MultiTurnWorkload, id_prefix: str = "") -> None:
        self.engine = engine
        self.workload = workload
        self.id_prefix = id_prefix
        self.system, self.sessions = make_sessions(workload, engine.loaded.arch.vocab_size)
        self.tally = _Tally()
        self.ready = deque(range(len(self.sessions)))  # sessions whose next turn may start
        self.in_flight: dict[str, tuple[int, list[int]]] = {}  # request -> (session, reply)

    def run(self, bar: tqdm[Any] | None = None) -> None:
        while self.ready or self.in_flight:
            while self.ready and len(self.in_flight) < self.workload.concurrency:
                self._submit(self.ready.popleft())
            for out in self.engine.step():
                index, reply = self.in_flight[out.request_id]
                reply += out.new_token_ids
                if out.new_token_ids:
                    self.tally.ttft_s.setdefault(out.request_id, time.perf_counter())
                if out.finished:
                    del self.in_flight[out.request_id]
                    self._end_turn(index, out.request_id, reply, out.usage)
                    if bar is not None:
                        bar.update(1)

    def _submit(self, index: int) -> None:
        session = self.sessions[index]
        request_id = f"{self.id_prefix}s{index}-t{session.num_done}"
        prompt = session.next_prompt(self.system)
        sampling = SamplingParams(
            temperature=0, max_tokens=self.workload.output_len, ignore_eos=True
        )
        self.engine.add_request(request_id, prompt_token_ids=prompt, sampling=sampling)
        self.tally.submitted_s[request_id] = time.perf_counter()
        self.tally.num_input_tokens += len(prompt)
        self.in_flight[request_id] = (index, [])

    def _end_turn(self, index: int, request_id: str, reply: list[int], usage: Usage | None) -> None:
        self.tally.num_output_tokens += len(reply)
        self.tally.num_cached_tokens += usage.cached_prompt_tokens if usage is not None else 0
        self.tally.replies[request_id] = reply
        self.sessions[index].add_reply(reply)
        if self.sessions[index].num_done < self.workload.num_turns:
            self.ready.append(index)


def _measure(
    engine: LLMEngine, workload: MultiTurnWorkload, use_tqdm: bool, desc: str
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Warm up, then drive every session through its turns; the results and each reply."""
    _Chats(engine, warmup_workload(workload), id_prefix="warmup-").run()
    stats_before = engine.stats()
    chats = _Chats(engine, workload)
    start_s = time.perf_counter()
    total = workload.num_sessions * workload.num_turns
    with tqdm(total=total, disable=not use_tqdm, desc=desc, unit="turn") as bar:
        chats.run(bar)
    elapsed_s = time.perf_counter() - start_s
    return _results(engine, chats.tally, elapsed_s, stats_before), chats.tally.replies


def warmup_workload(workload: MultiTurnWorkload) -> MultiTurnWorkload:
    """The untimed run before each measured one: the same shapes of steps (a batch of
    sessions, a second turn on a history), short replies, and other tokens (another seed), so
    kernel compiles stay out of the timing and nothing of it is cached for the timed run."""
    return dataclasses.replace(
        workload,
        num_sessions=min(workload.concurrency, workload.num_sessions),
        num_turns=min(WARMUP_TURNS, workload.num_turns),
        output_len=min(WARMUP_OUTPUT_LEN, workload.output_len),
        seed=workload.seed + 1,
    )


def _results(
    engine: LLMEngine, tally: _Tally, elapsed_s: float, stats_before: EngineStats
) -> dict[str, Any]:
    ttft = {rid: first_s - tally.submitted_s[rid] for rid, first_s in tally.ttft_s.items()}
    later = [value for rid, value in ttft.items() if not rid.endswith("-t0")]
    stats = engine.stats()
    return {
        "elapsed_s": elapsed_s,
        "num_requests": len(tally.submitted_s),
        "input_tokens": tally.num_input_tokens,
        "output_tokens": tally.num_output_tokens,
        "output_tok_s": tally.num_output_tokens / elapsed_s,
        "total_tok_s": (tally.num_input_tokens + tally.num_output_tokens) / elapsed_s,
        "ttft_s": percentiles(list(ttft.values())),
        "ttft_later_turns_s": percentiles(later),  # turns with a history to reuse
        "prefix_hit_rate": tally.num_cached_tokens / tally.num_input_tokens,
        "prefix_cache": prefix_cache_counts(stats_before, stats),
        "num_preemptions": stats.num_preemptions - stats_before.num_preemptions,
    }


def format_results(results: dict[str, Any]) -> str:
    """Off and on side by side."""
    off, on = results["offload_off"], results["offload_on"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    rows = [
        ("TTFT p50 ms", ms(off["ttft_s"]["p50"]), ms(on["ttft_s"]["p50"])),
        ("TTFT p90 ms", ms(off["ttft_s"]["p90"]), ms(on["ttft_s"]["p90"])),
        ("later-turn TTFT p50 ms", ms(off["ttft_later_turns_s"]["p50"]),
         ms(on["ttft_later_turns_s"]["p50"])),
        ("output tok/s", f"{off['output_tok_s']:.1f}", f"{on['output_tok_s']:.1f}"),
        ("total tok/s", f"{off['total_tok_s']:.1f}", f"{on['total_tok_s']:.1f}"),
        ("GPU hit tokens", f"{off['prefix_cache']['device_hit_tokens']}",
         f"{on['prefix_cache']['device_hit_tokens']}"),
        ("host hit tokens", f"{off['prefix_cache']['host_hit_tokens']}",
         f"{on['prefix_cache']['host_hit_tokens']}"),
        ("pages offloaded", "0", f"{on['prefix_cache']['offloaded_pages']}"),
        ("preemptions", f"{off['num_preemptions']}", f"{on['num_preemptions']}"),
    ]  # fmt: skip
    width = max(len(row[0]) for row in rows)
    lines = [f"{'':<{width}}  {'offload off':>12}  {'offload on':>12}"]
    lines += [f"{name:<{width}}  {a:>12}  {b:>12}" for name, a, b in rows]
    return "\n".join(lines)
