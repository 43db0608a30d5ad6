"""The all-reduce + residual add + RMSNorm kernel against its torch reference, in one process:
the other ranks' buffers are faked (filled here, the barrier skipped), which tests the sum, the
norm, the slots and the epoch; and the barrier's signals, the other rank's arrival faked in
this rank's pad, or an abort. Across two real GPUs: tests/test_gpu_allreduce_norm.py.

Without CUDA the kernel runs on the CPU through Triton's interpreter, at small sizes.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import CUDA, DEVICE, import_kernels

KERNELS = import_kernels(
    (
        "kernels.elementwise.norm_triton",
        "kernels.collective.peer_barrier_triton",
        "kernels.collective.allreduce_norm_triton",
    )
)
allreduce_norm_triton = KERNELS["allreduce_norm_triton"]
PeerBuffers = allreduce_norm_triton.PeerBuffers

from kernels.collective.allreduce_norm import allreduce_add_rms_norm_ref  # noqa: E402

SLOT_BYTES = 64 * 128 * 4  # the largest test message: 64 rows of 128 fp32
EPS = 1e-6
# One rounding of each dtype (the fp32 statistics may add in another order). The sum and the
# residual follow the reference's roundings, bit for bit, except that the interpreter truncates
# fp32 -> bf16 casts (Triton 3.9): the sum's ulp (|sum| < 16), carried through the residual add
INTERPRETED_BF16_ATOL = 2.0**-4
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}


class FakePeers:
    """Every rank's two-slot buffer in one tensor; this process is rank ``rank``."""

    def __init__(
        self, world_size: int, rank: int, dtype: torch.dtype, barrier: bool = False
    ) -> None:
        numel = SLOT_BYTES // dtype.itemsize
        self.buffers = torch.zeros(world_size, 2, numel, dtype=dtype, device=DEVICE)
        num_slots = 2 * allreduce_norm_triton.MAX_PROGRAMS * world_size
        self.pads = torch.zeros(world_size, num_slots, dtype=torch.int32, device=DEVICE)
        self.peers = PeerBuffers(
            buffer_ptrs=torch.tensor([b.data_ptr() for b in self.buffers], device=DEVICE),
            signal_pad_ptrs=torch.tensor([p.data_ptr() for p in self.pads], device=DEVICE),
            epoch=torch.zeros(2, dtype=torch.int32, device=DEVICE),
            abort=torch.zeros(1, dtype=torch.int32, device=DEVICE),
            rank=rank,
            slot_bytes=SLOT_BYTES,
            barrier=barrier,
        )

    def signal_slot(self, program: int, rank: int) -> int:
        """Where ``rank``'s arrival for ``program`` goes in every pad."""
        offset = allreduce_norm_triton.MAX_PROGRAMS  # past torch's own kernels' slots
        return (offset + program) * self.peers.world_size + rank

    def post(self, partials: torch.Tensor, slot: int) -> None:  # partials [world, T, N]
        """What the other ranks would have copied into their slot ``slot``."""
        for rank, partial in enumerate(partials):
            if rank != self.peers.rank:
                self.buffers[rank, slot, : partial.numel()] = partial.reshape(-1)


def _inputs(
    world_size: int, rows: int, size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # partials, residual, weight
    gen = torch.Generator().manual_seed(seed)
    partials = torch.randn(world_size, rows, size, generator=gen).to(dtype).to(DEVICE)
    residual = (torch.randn(rows, size, generator=gen) * 2).to(dtype).to(DEVICE)
    return partials, residual, torch.randn(size, generator=gen).to(dtype).to(DEVICE)


def _assert_residual(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if CUDA or actual.dtype != torch.bfloat16:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, atol=INTERPRETED_BF16_ATOL, rtol=2.0**-7)


def _fused_and_expected(
    partials: torch.Tensor,  # [world, T, H]: every rank's share
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    fake: FakePeers,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's (normed, new residual) as rank ``rank``, and the reference's, taken
    before the kernel adds into ``residual`` in place."""
    expected_normed, expected_sum = allreduce_add_rms_norm_ref(
        partials.cpu(), None if residual is None else residual.cpu(), weight.cpu(), EPS
    )
    normed, total = allreduce_norm_triton.allreduce_add_rms_norm(
        partials[rank], residual, weight, EPS, fake.peers
    )
    return normed, total, expected_normed, expected_sum


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("world_size", "rank", "rows", "size"), [(2, 0, 1, 128), (3, 1, 5, 96)])
def test_the_sum_plus_residual_and_its_norm_match_the_reference(
    dtype: torch.dtype, world_size: int, rank: int, rows: int, size: int
) -> None:
    partials, residual, weight = _inputs(world_size, rows, size, dtype, seed=rows + size)
    fake = FakePeers(world_size, rank, dtype)
    fake.post(partials, slot=0)
    normed, new_residual, expected_normed, expected_sum = _fused_and_expected(
        partials, residual, weight, fake, rank
    )
    assert new_residual.data_ptr() == residual.data_ptr()  # in place, as fused_add_rms_norm
    _assert_residual(new_residual.cpu(), expected_sum)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(normed.cpu(), expected_normed, atol=tol, rtol=tol)
    # this rank's share went into its own slot 0, for the other ranks to read
    assert torch.equal(fake.buffers[rank, 0, : rows * size].view(rows, size), partials[rank])


def test_without_a_residual_the_sum_is_the_new_residual_and_fp32_weights_promote() -> None:
    partials, _, weight = _inputs(2, 3, 64, torch.bfloat16, seed=7)
    weight = weight.float()
    fake = FakePeers(2, 1, torch.bfloat16)
    fake.post(partials, slot=0)
    normed, total, expected_normed, expected_sum = _fused_and_expected(
        partials, None, weight, fake, rank=1
    )
    assert normed.dtype == torch.float32 and total.dtype == torch.bfloat16
    _assert_residual(total.cpu(), expected_sum)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(normed.cpu(), expected_normed, atol=tol, rtol=tol)


def test_calls_alternate_slots_and_more_rows_than_programs_loop() -> None:
    """The epoch advances once a call (by its last program), whatever the grid: a call's
    slot is the other one of the call before, and rows past MAX_PROGRAMS loop."""
    rows = allreduce_norm_triton.MAX_PROGRAMS + 3
    fake = FakePeers(2, 0, torch.float32)
    for call, size in enumerate([16, 8, 16]):
        partials, residual, weight = _inputs(2, rows, size, torch.float32, seed=call)
        slot = call % 2
        fake.buffers[0, slot].zero_()
        fake.post(partials, slot)
        normed, total, expected_normed, expected_sum = _fused_and_expected(
            partials, residual, weight, fake, rank=0
        )
        assert torch.equal(total.cpu(), expected_sum)
        torch.testing.assert_close(normed.cpu(), expected_normed, atol=2e-5, rtol=2e-5)
        assert torch.equal(fake.buffers[0, slot, : rows * size].view(rows, size), partials[0])
        assert fake.peers.epoch.tolist() == [(call + 1) % 2, 0]  # the done count back to 0


def test_a_message_larger_than_a_slot_is_refused() -> None:
    fake = FakePeers(2, 0, torch.float32)
    x = torch.zeros(SLOT_BYTES // 4 // 64 + 1, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {SLOT_BYTES} bytes"):
        allreduce_norm_triton.allreduce_add_rms_norm(x, x.clone(), weight, EPS, fake.peers)


def test_the_barrier_takes_the_other_ranks_arrival_and_leaves_its_own() -> None:
    """Rank 0 of two, rank 1's arrival already in its pad for each program: each program
    takes it (back to 0, ready for the next call) and leaves its own in rank 1's pad."""
    rows = 3
    partials, residual, weight = _inputs(2, rows, 32, torch.float32, seed=5)
    fake = FakePeers(2, 0, torch.float32, barrier=True)
    fake.post(partials, slot=0)
    for program in range(rows):
        fake.pads[0, fake.signal_slot(program, rank=1)] = 1
    normed, total, expected_normed, expected_sum = _fused_and_expected(
        partials, residual, weight, fake, rank=0
    )
    assert torch.equal(total.cpu(), expected_sum)
    torch.testing.assert_close(normed.cpu(), expected_normed, atol=2e-5, rtol=2e-5)
    assert not fake.pads[0].any()
    arrivals = [fake.signal_slot(program, rank=0) for program in range(rows)]
    assert fake.pads[1].nonzero().flatten().tolist() == arrivals


def test_an_abort_ends_the_wait_for_a_rank_that_never_arrives() -> None:
    partials, residual, weight = _inputs(2, 1, 32, torch.float32, seed=6)
    fake = FakePeers(2, 1, torch.float32, barrier=True)
    fake.peers.abort.fill_(1)  # set by the host once rank 0 is gone
    allreduce_norm_triton.allreduce_add_rms_norm(partials[1], residual, weight, EPS, fake.peers)
    assert fake.pads[0, fake.signal_slot(0, rank=1)] == 1  # arrived; nobody took it
    assert fake.peers.epoch.tolist() == [1, 0]  # the call ended as calls do
