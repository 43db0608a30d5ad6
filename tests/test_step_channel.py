"""Rank 0's step messages through the shared-memory ring (engine/distributed/step_channel.py):
every rank gets every step in order, a message too large for a slot takes the overflow path,
rank 0 waits while a rank is a whole ring behind, and a gone rank 0 is end-of-file."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading

import pytest

from engine.distributed import step_channel
from engine.distributed.step_channel import SLOTS, StepChannel
from engine.host_inputs import HostInputs, StepMessage
from engine.kv_offload import PageCopy, PageTransfer


def _message(step: int, num_rows: int = 2) -> StepMessage:
    inputs = HostInputs(
        token_ids=[step] * num_rows,
        positions=list(range(num_rows)),
        slots=list(range(num_rows)),
        tables=[[step, 1]] * num_rows,
        seq_lens=[1] * num_rows,
        query_start_loc=list(range(num_rows + 1)),
        logits_indices=None,
        num_samples=num_rows,
        has_pending=False,
    )
    moves = [PageTransfer(step, 1, True), PageCopy(step, step + 1)]  # both kinds, in order
    return StepMessage([(step, 0)], moves, [], inputs)


def _ranks(size: int) -> tuple[StepChannel, list[StepChannel]]:
    sender = StepChannel.create(size)
    ends = [sender.end_for(rank) for rank in range(1, size)]
    # a rank's process holds its own copy of the read end (pass_fds); here, a duplicate
    receivers = [
        StepChannel.attach(dataclasses.replace(end, read_fd=os.dup(end.read_fd)), rank)
        for rank, end in enumerate(ends, start=1)
    ]
    sender.started()
    return sender, receivers


def test_every_rank_gets_every_step_in_order_then_stop() -> None:
    sender, receivers = _ranks(3)
    got: list[list[StepMessage | None]] = [[] for _ in receivers]

    def serve(index: int) -> None:
        while (message := receivers[index].receive(overflow=None)) is not None:
            got[index].append(message)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(receivers))]
    for thread in threads:
        thread.start()
    sent = [_message(step) for step in range(3 * SLOTS)]
    for message in [*sent, None]:
        sender.send(message, overflow=None)
    for thread in threads:
        thread.join(10)
    assert got == [sent, sent]
    for channel in [sender, *receivers]:
        channel.close()


def test_a_message_larger_than_a_slot_goes_over_the_overflow_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(step_channel, "SLOT_BYTES", 4096)
    sender, (receiver,) = _ranks(2)
    side: queue.Queue[StepMessage | None] = queue.Queue()
    small, large = _message(1), _message(2, num_rows=1000)  # about 16 KB
    sender.send(small, overflow=side.put)
    sender.send(large, overflow=side.put)
    assert side.qsize() == 1  # only the large one went the other way
    assert receiver.receive(overflow=side.get) == small
    assert receiver.receive(overflow=side.get) == large
    sender.close()
    receiver.close()


def test_rank_0_waits_while_a_rank_is_a_ring_behind() -> None:
    sender, (receiver,) = _ranks(2)
    for step in range(SLOTS):
        sender.send(_message(step), overflow=None)
    blocked = threading.Thread(target=sender.send, args=(_message(SLOTS), None))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # its slot still holds step 0, not yet taken
    assert receiver.receive(overflow=None) == _message(0)
    blocked.join(5)
    assert not blocked.is_alive()
    assert [receiver.receive(overflow=None) for _ in range(SLOTS)] == [
        _message(step) for step in range(1, SLOTS + 1)
    ]
    sender.close()
    receiver.close()


def test_a_rank_sees_end_of_file_once_rank_0_is_gone_and_rank_0_a_gone_rank() -> None:
    sender, (receiver,) = _ranks(2)
    sender.close()
    with pytest.raises(EOFError):
        receiver.receive(overflow=None)
    sender, (receiver,) = _ranks(2)
    receiver.close()
    with pytest.raises(RuntimeError, match="rank 1's step pipe is closed"):
        sender.send(_message(0), overflow=None)
    sender.close()
