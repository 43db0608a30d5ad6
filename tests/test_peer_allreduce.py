"""Which path sums a message of each size (the peer buffers themselves need two GPUs:
tests/test_gpu_tensor_parallel.py)."""

from __future__ import annotations

import datetime
import multiprocessing
from typing import Any

import pytest

from bench.allreduce import suggested_bands
from engine.distributed.peer_allreduce import (
    ALLREDUCE_ENV,
    MAX_PEER_BYTES,
    SizeTable,
    SymmetricGroup,
    requested_method,
    size_table,
)
from engine.errors import ConfigError
from worker.local_stack import free_port


def test_bands_pick_the_first_that_holds_the_message_and_nccl_past_them() -> None:
    table = SizeTable(bands=((2**20, "nccl"), (MAX_PEER_BYTES, "two-shot")))
    assert table.method_for(8192) == "nccl"
    assert table.method_for(2**20 + 2) == "two-shot"
    assert table.method_for(MAX_PEER_BYTES) == "two-shot"
    assert table.method_for(MAX_PEER_BYTES + 2) == "nccl"
    assert size_table(3) == size_table(2) and size_table(8) == size_table(4)


def test_measured_rows_become_bands_of_the_fastest_path() -> None:
    timings = {
        8192: {"nccl": 7.0, "one-shot": 7.6, "two-shot": 10.2},
        65536: {"nccl": 7.4, "one-shot": 7.9, "two-shot": 11.4},
        2**21: {"nccl": 26.9, "one-shot": 20.6, "two-shot": 19.4},
        2**23: {"nccl": 46.3, "one-shot": 57.1, "two-shot": 42.4},
    }
    rows = [
        {"bytes": size, "method": method, "us": us}
        for size, by_method in timings.items()
        for method, us in by_method.items()
    ]
    assert suggested_bands(rows) == [(65536, "nccl"), (2**23, "two-shot")]


def test_an_unknown_path_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLREDUCE_ENV, "One-Shot ")
    assert requested_method() == "one-shot"
    monkeypatch.setenv(ALLREDUCE_ENV, "ring")
    with pytest.raises(ConfigError, match="expected one of auto, nccl, one-shot, two-shot"):
        requested_method()


def _register_twice(rank: int, ports: list[int], queue: Any) -> None:
    """One rank of two engines in turn, each with its own store (as ``RankProcesses``
    makes one per engine): the symmetric-memory names it registered."""
    import torch.distributed as dist

    names = []
    for port in ports:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=_STORE_TIMEOUT)
        names.append(SymmetricGroup.register(store, rank, 2).name)
    queue.put((rank, names))


_STORE_TIMEOUT = datetime.timedelta(seconds=30)


def test_each_engine_registers_its_own_symmetric_group_name_on_every_rank() -> None:
    """Issue 28's hang: torch keeps a name's store for the process's life, and a second
    engine's process group comes back under the first one's name; each engine's buffers
    take a new name, the same on every rank, which torch accepts (it refuses a name twice)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ports = [free_port(), free_port()]
    ranks = [context.Process(target=_register_twice, args=(r, ports, queue)) for r in (0, 1)]
    for process in ranks:
        process.start()
    results = dict(queue.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
        assert process.exitcode == 0
    assert results[0] == results[1]
    first, second = results[0]
    assert first != second and all(n.startswith("pagestream-tp-") for n in (first, second))
