"""Which path sums a message of each size (the peer buffers themselves need two GPUs:
tests/test_gpu_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from bench.allreduce import suggested_bands
from engine.distributed.peer_allreduce import (
    ALLREDUCE_ENV,
    MAX_PEER_BYTES,
    SizeTable,
    agree_to_map,
    requested_method,
    size_table,
)
from engine.errors import ConfigError


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


def test_rank_0_maps_peer_buffers_once_per_process_and_every_rank_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28's hang: torch's symmetric memory numbers its rendezvous exchanges per
    process, so a second group of a long-lived rank 0 with new ranks would wait forever.
    Rank 0 maps for its process's first group only, and a new rank (whose own process never
    mapped) follows rank 0's word rather than its own state."""
    import threading

    import torch.distributed as dist

    from engine.distributed import peer_allreduce

    monkeypatch.setattr(peer_allreduce, "_process", {"mapped": False})

    def group_of_two(possible: bool) -> list[bool]:
        store, answers = dist.HashStore(), [False, False]
        follower = threading.Thread(
            target=lambda: answers.__setitem__(1, agree_to_map(store, 1, possible))
        )
        follower.start()  # waits for rank 0's word
        answers[0] = agree_to_map(store, 0, possible)
        follower.join(10)
        return answers

    assert group_of_two(possible=False) == [False, False]  # nothing mapped: the first is next
    assert group_of_two(possible=True) == [True, True]
    assert group_of_two(possible=True) == [False, False]  # rank 0's process mapped before
