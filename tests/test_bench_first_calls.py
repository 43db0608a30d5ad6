"""bench/first_calls.py: a sweep's first calls give their results in the grid's order, None
for a launch shape that does not fit the GPU, and any other error stops the sweep."""

from __future__ import annotations

import pytest
import triton

from bench.first_calls import first_calls


def _does_not_fit() -> int:
    raise triton.runtime.errors.OutOfResources(232448, 101376, "shared memory")


def test_results_in_order_and_none_where_a_shape_does_not_fit() -> None:
    calls: list[int] = []

    def call(value: int) -> int:
        calls.append(value)
        return value

    fns = [lambda: call(1), _does_not_fit, lambda: call(3)]
    assert first_calls(fns) == [1, None, 3]
    assert sorted(calls) == [1, 3]  # each called once
    assert first_calls([]) == []


def test_another_error_is_raised() -> None:
    def broken() -> int:
        raise ValueError("bad launch")

    with pytest.raises(ValueError, match="bad launch"):
        first_calls([lambda: 1, broken])
