"""``pagestream bench redis-scale``: the tokens/s one Redis primary streams, against an
N-primary Redis Cluster, with Redis as the only bottleneck (issue 31's target: a 3-primary
cluster streams at least 2.5x the tokens/s of one primary).

For each setup, one standalone primary ("single", one request stream) and then an N-primary
cluster ("cluster", N shards; with ``--home-shards`` a second time with each reader a client
whose requests all lie on one shard, its home shard), this starts its own redis-servers
(``bench.redis_nodes``), runs the same load (``bench.redis_scale_load``: producers that are
workers without an engine, readers that are clients) for ``--duration-s``, and reads every
primary's ``INFO cpu`` and ``INFO commandstats`` before and after. A row per setup: tokens/s
written and read end to end (the counts must match), Redis commands/s and CPU per token summed
over the primaries, each primary's busy fraction, and the cores each group of processes used.
The record's ``ratio`` is cluster over single tokens/s.

Placement: with enough cores (``--pin auto``), primary i runs on core i alone (its
hyperthread sibling left idle) and the load on the other cores; the single primary takes the
first primary's core, and the load keeps the same cores in both setups.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.redis_cost import RedisCounters, per_token, read_redis_counters
from bench.redis_nodes import RedisNodes
from bench.redis_scale_load import LoadSettings, RunLink, run_producer, run_reader
from bench.redis_scale_report import format_row, make_record
from worker.errors import CommandError

START_TIMEOUT_S = 60.0  # every load process connected
DRAIN_TIMEOUT_S = 120.0  # after --duration-s, the requests in flight finish within this
READ_HEADROOM = 1.25  # readers keep this many times the producers' slots in flight


@dataclass(frozen=True)
class ScaleSettings:
    """One run's settings; process counts left None are derived from the cores."""

    num_primaries: int = 3
    num_producers: int | None = None
    num_readers: int | None = None
    streams_per_producer: int = 128
    output_len: int = 64
    steps_per_write: int = 1
    duration_s: float = 20.0
    pin: str = "auto"  # auto / on / off
    appendonly: bool = False
    prefix: str = "pagestream"
    home_shards: bool = False  # also the cluster with every reader on a home shard

    def __post_init__(self) -> None:
        checks = (
            (self.num_primaries >= 2, "--primaries must be >= 2 (the single primary is the baseline)"),
            (self.streams_per_producer >= 1, "--streams-per-producer must be >= 1"),
            (self.output_len >= 1, "--output-len must be >= 1"),
            (self.steps_per_write >= 1, "--steps-per-write must be >= 1"),
            (self.duration_s > 0, "--duration-s must be > 0"),
            (self.pin in ("auto", "on", "off"), "--pin must be auto, on or off"),
            (not self.home_shards or self.num_readers is None
             or self.num_readers % self.num_primaries == 0,
             "--home-shards needs the readers to be a multiple of --primaries (each shard "
             "as many)"),
        )  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise CommandError(message)


@dataclass(frozen=True)
class Placement:
    """Where the processes run: ``redis_cores[i]`` holds primary i (empty: not pinned);
    the load runs on ``load_cores`` (empty: anywhere)."""

    redis_cores: list[int]
    load_cores: list[int]
    num_producers: int
    num_readers: int

    @property
    def pinned(self) -> bool:
        return bool(self.redis_cores)


def available_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_placement(settings: ScaleSettings, cores: list[int]) -> Placement:
    """Pin the primaries to the first cores (each core's hyperthread siblings kept idle) and
    the load to the rest, when there are enough cores (``--pin auto``: two left for the
    load at least); split the load cores between producers and readers."""
    redis_cores: list[int] = []
    load_cores = list(cores)
    if settings.pin == "on" or (
        settings.pin == "auto" and len(cores) >= settings.num_primaries + 2
    ):
        for core in cores:
            if len(redis_cores) == settings.num_primaries:
                break
            if core in load_cores:
                redis_cores.append(core)
                load_cores = [c for c in load_cores if c not in _siblings(core)]
        if len(redis_cores) < settings.num_primaries or not load_cores:
            raise CommandError(f"--pin on: {len(cores)} cores cannot hold "
                               f"{settings.num_primaries} primaries and the load")  # fmt: skip
    producers = settings.num_producers or max(1, len(load_cores) // 2)
    readers = settings.num_readers or max(1, len(load_cores) - producers)
    if settings.home_shards and not settings.num_readers:  # as many readers on every shard
        readers = max(
            settings.num_primaries, readers // settings.num_primaries * settings.num_primaries
        )
    return Placement(redis_cores, load_cores if redis_cores else [], producers, readers)


def _siblings(core: int) -> set[int]:
    """``core`` and its hyperthread siblings (Linux sysfs; just ``core`` elsewhere)."""
    path = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return {core}
    found = {core}
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def run_scale(settings: ScaleSettings) -> dict[str, Any]:
    """Both setups in turn; the record."""
    raise_open_files_limit()
    placement = plan_placement(settings, available_cores())
    _say(f"{len(available_cores())} cores; primaries on {placement.redis_cores or 'any core'}, "
         f"{placement.num_producers} producers and {placement.num_readers} readers on "
         f"{placement.load_cores or 'any core'}")  # fmt: skip
    rows = [run_setup(settings, placement, cluster=False),
            run_setup(settings, placement, cluster=True)]  # fmt: skip
    if settings.home_shards:
        rows.append(run_setup(settings, placement, cluster=True, home_shards=True))
    return make_record({**asdict(settings), **asdict(placement)}, rows,
                       num_primaries=settings.num_primaries, num_cores=len(available_cores()))  # fmt: skip


def raise_open_files_limit() -> None:
    """Open files up to the hard limit, for this process and what it starts: a cluster's
    clients hold a connection per stream and per concurrent script call, thousands per
    primary on a large host, and a redis-server caps its clients at its own limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_setup(
    settings: ScaleSettings, placement: Placement, *, cluster: bool, home_shards: bool = False
) -> dict[str, Any]:
    """One setup: its redis-servers, the load for ``duration_s``, the counters: its row."""
    num_primaries = settings.num_primaries if cluster else 1
    name = "cluster" if cluster else "single"
    _say(f"{name}: starting {num_primaries} primar{'ies' if cluster else 'y'}")
    with tempfile.TemporaryDirectory(prefix="pagestream-redis-scale-") as directory:
        nodes = RedisNodes(Path(directory), num_primaries, cluster,
                           placement.redis_cores[:num_primaries], settings.appendonly)  # fmt: skip
        try:
            nodes.start()
            load = _load_settings(settings, placement, nodes, cluster, home_shards)
            row = _run_load(load, placement, nodes)
        finally:
            nodes.stop()
    row = {"redis": name, "primaries": num_primaries, "shards": load.num_shards,
           "readers_home_shards": home_shards, **row}  # fmt: skip
    _say(format_row(row))
    return row


def _load_settings(
    settings: ScaleSettings,
    placement: Placement,
    nodes: RedisNodes,
    cluster: bool,
    home_shards: bool,
) -> LoadSettings:
    slots = placement.num_producers * settings.streams_per_producer
    return LoadSettings(
        redis_url=nodes.url, cluster=cluster, prefix=settings.prefix,
        num_shards=nodes.num_primaries if cluster else 1,
        streams_per_producer=settings.streams_per_producer,
        streams_per_reader=-(-int(slots * READ_HEADROOM) // placement.num_readers),
        output_len=settings.output_len, steps_per_write=settings.steps_per_write,
        duration_s=settings.duration_s, cores=tuple(placement.load_cores),
        home_shards=home_shards,
    )  # fmt: skip


def _run_load(load: LoadSettings, placement: Placement, nodes: RedisNodes) -> dict[str, Any]:
    """Start the load processes, time them from ``go`` until every reader is done."""
    from bench.host_cpu import busy_cores, read_cpu_times

    # fork: the children inherit the imported modules (spawn would import torch in each)
    context = multiprocessing.get_context("fork")
    link = RunLink.create(context)
    producers = [context.Process(target=run_producer, args=(load, i, link), daemon=True)
                 for i in range(placement.num_producers)]  # fmt: skip
    readers = [context.Process(target=run_reader, args=(load, i, link), daemon=True)
               for i in range(placement.num_readers)]  # fmt: skip
    processes = producers + readers
    try:
        for process in processes:
            process.start()
        _wait_ready(link, processes)
        groups = {"redis": nodes.pids, "producers": [p.pid for p in producers if p.pid],
                  "readers": [p.pid for p in readers if p.pid]}  # fmt: skip
        before, cpu_before = read_counters(nodes), read_cpu_times(groups)
        start_s = time.perf_counter()
        link.go.set()
        reads = _collect(link, "reader", len(readers), processes, load.duration_s + DRAIN_TIMEOUT_S)
        elapsed_s = time.perf_counter() - start_s
        after, cpu_after = read_counters(nodes), read_cpu_times(groups)
        link.stop.set()
        writes = _collect(link, "producer", len(producers), processes, DRAIN_TIMEOUT_S)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
    return measure(before, after, reads, writes, elapsed_s, busy_cores(cpu_before, cpu_after)) | {
        "producers": len(producers), "readers": len(readers),
        "streams_per_reader": load.streams_per_reader,
    }  # fmt: skip


def _wait_ready(link: RunLink, processes: list[Any]) -> None:
    deadline_s = time.monotonic() + START_TIMEOUT_S
    for _ in processes:
        while True:
            _check_alive(link, processes)
            try:
                link.ready.get(timeout=1.0)
                break
            except queue.Empty:
                if time.monotonic() > deadline_s:
                    raise CommandError(
                        f"the load processes did not connect in {START_TIMEOUT_S:g} s"
                    ) from None


def _collect(
    link: RunLink, role: str, count: int, processes: list[Any], timeout_s: float
) -> list[dict[str, Any]]:
    """The counts of ``count`` processes of ``role``; raises on a failed process or timeout."""
    deadline_s = time.monotonic() + timeout_s
    found: list[dict[str, Any]] = []
    while len(found) < count:
        try:
            got_role, _, counts = link.results.get(timeout=1.0)
        except queue.Empty:
            _check_alive(link, processes)
            if time.monotonic() > deadline_s:
                raise CommandError(f"{count - len(found)} {role}s still running after "
                                   f"{timeout_s:g} s") from None  # fmt: skip
            continue
        if got_role == "error":
            raise CommandError(f"a load process failed: {counts}")
        if got_role != role:
            raise CommandError(f"a {got_role} finished before the {role}s: {counts}")
        found.append(counts)
    return found


def _check_alive(link: RunLink, processes: list[Any]) -> None:
    failed = [p for p in processes if p.exitcode not in (None, 0)]
    if failed:
        try:
            role, _, message = link.results.get(timeout=1.0)
        except queue.Empty:
            role, message = "", ""
        detail = message if role == "error" else f"exit code {failed[0].exitcode}"
        raise CommandError(f"a load process failed: {detail}")


def read_counters(nodes: RedisNodes) -> list[RedisCounters]:
    """``INFO commandstats`` and ``INFO cpu`` of every primary."""
    import redis.asyncio as aioredis

    async def read() -> list[RedisCounters]:
        clients = [aioredis.Redis(port=port) for port in nodes.ports]
        try:
            return [await read_redis_counters(client) for client in clients]
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(read())


def sum_counters(counters: list[RedisCounters]) -> RedisCounters:
    """The primaries' counters added up (``INFO`` calls, the readings', left out)."""
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for node in counters:
        for name, value in node.calls.items():
            if name != "info":
                calls[name] = calls.get(name, 0) + value
                usec[name] = usec.get(name, 0) + node.usec[name]
    return RedisCounters(calls, usec, sum(node.cpu_s for node in counters))


def measure(
    before: list[RedisCounters],
    after: list[RedisCounters],
    reads: list[dict[str, Any]],
    writes: list[dict[str, Any]],
    elapsed_s: float,
    busy: dict[str, float] | None,
) -> dict[str, Any]:
    """A setup's figures from its counters and the processes' counts."""
    tokens_read = sum(r["num_tokens"] for r in reads)
    tokens_written = sum(w["num_tokens"] for w in writes)
    events = sum(r["num_token_events"] for r in reads)
    cost = per_token(sum_counters(before), sum_counters(after),
                     num_tokens=tokens_read, num_token_events=events)  # fmt: skip
    num_commands = cost["redis_calls_per_token"] * tokens_read
    return {
        "elapsed_s": elapsed_s,
        "requests": sum(r["num_requests"] for r in reads),
        "requests_written": sum(w["num_requests"] for w in writes),
        "mismatched_requests": sum(r["num_mismatched"] for r in reads),
        "tokens_written": tokens_written,
        "tokens_read": tokens_read,
        "token_events_read": events,
        "token_events_written": sum(w["num_token_events"] for w in writes),
        "tokens_per_s": tokens_read / elapsed_s,
        "token_events_per_s": events / elapsed_s,
        "redis_commands_per_s": num_commands / elapsed_s,
        "redis_cpu_us_per_token": cost["redis_cpu_us_per_token"],
        "redis_cpu_busy_by_primary": [
            (a.cpu_s - b.cpu_s) / elapsed_s for b, a in zip(before, after, strict=True)
        ],
        "busy_cores": busy,
        "cost": cost,
    }


def _say(text: str) -> None:
    print(text, flush=True)
