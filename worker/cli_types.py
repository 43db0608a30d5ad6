"""Argument types shared by the subcommands' parsers."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def int_range(text: str) -> tuple[int, int]:
    """``"100-1024"`` -> (100, 1024); a single number N is the range N-N."""
    low, _, high = text.partition("-")
    high = high or low
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)
