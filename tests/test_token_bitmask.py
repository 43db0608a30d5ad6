"""Token bitmasks: the Triton kernel against the torch reference, the reference against a
plain loop, and the masks a step fills against what the grammar accepts token by token."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling.token_bitmask import apply_token_bitmask_ref, unpack_bitmask_ref
from tests.triton_interpret import DEVICE, import_kernels


def _kernel_module():  # type: ignore[no-untyped-def]
    """The kernel module, decorated for the interpreter when there is no GPU."""
    return import_kernels(("kernels.sampling.token_bitmask_triton",))["token_bitmask_triton"]


def random_bitmask(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    words = -(-vocab_size // 32)
    return torch.randint(
        -(2**31), 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=generator
    )


def test_the_reference_unpacks_bit_t_of_word_t_over_32() -> None:
    bitmask = random_bitmask(3, 100, seed=0)
    allowed = unpack_bitmask_ref(bitmask, 100)
    for row in range(3):
        for token in range(100):
            bit = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert bool(allowed[row, token]) == bool(bit), (row, token)


def test_the_reference_masks_only_the_chosen_rows() -> None:
    logits = torch.randn(5, 70)
    bitmask = random_bitmask(2, 70, seed=1)
    out = logits.clone()
    apply_token_bitmask_ref(out, bitmask, torch.tensor([3, 0]))
    allowed = unpack_bitmask_ref(bitmask, 70)
    for mask_row, row in ((0, 3), (1, 0)):
        expected = logits[row].masked_fill(~allowed[mask_row], float("-inf"))
        assert torch.equal(out[row], expected)
    assert torch.equal(out[[1, 2, 4]], logits[[1, 2, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_rows", "vocab_size", "num_masked"), [(4, 100, 2), (3, 2085, 3), (6, 1024, 1)]
)
def test_the_triton_kernel_matches_the_reference(
    dtype: torch.dtype, num_rows: int, vocab_size: int, num_masked: int
) -> None:
    kernel = _kernel_module()
    logits = torch.randn(num_rows, vocab_size, device=DEVICE).to(dtype)
    bitmask = random_bitmask(num_masked, vocab_size, seed=vocab_size).to(DEVICE)
    rows = torch.randperm(num_rows, generator=torch.Generator().manual_seed(2))[:num_masked]
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows.to(DEVICE))
    kernel.apply_token_bitmask(logits, bitmask, rows.to(DEVICE))
    assert torch.equal(logits, expected)


def test_the_triton_kernel_checks_its_arguments() -> None:
    kernel = _kernel_module()
    logits = torch.randn(2, 64, device=DEVICE)
    bitmask = random_bitmask(1, 64, seed=3).to(DEVICE)
    with pytest.raises(ValueError, match="int32"):
        kernel.apply_token_bitmask(logits, bitmask.long(), torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="row_index"):
        kernel.apply_token_bitmask(logits, bitmask, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="logits"):
        kernel.apply_token_bitmask(logits.int(), bitmask, torch.tensor([0], device=DEVICE))
