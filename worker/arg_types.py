"""Argument types and flag groups shared by the subcommands' parsers (no torch import)."""

from __future__ import annotations

import argparse
import json
from typing import Any

# The sampling flags of the client-side verbs (submit, batch submit): a request's fields.
CLIENT_SAMPLING_FLAGS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "structured_outputs",
)
STRUCTURED_OUTPUTS_HELP = (
    'constrain the output, as a JSON object: {"json_schema": {...}}, {"json_object": true}, '
    '{"regex": "..."}, {"grammar": "..."} or {"choice": [...]} (docs/structured-outputs.md)'
)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def on_off(text: str) -> bool:
    """``on``/``off``; ``1/0``, ``true/false`` and ``yes/no`` too (for environment variables).

    The engine's flags parse the same words (``engine.config_flags``); that module imports the
    engine, and so torch, which the gateway and the client commands must not load."""
    word = text.strip().lower()
    if word in ("on", "1", "true", "yes"):
        return True
    if word in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def positive_int(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of 0 or more (0 usually meaning "off")."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer of 0 or more, got {text!r}")
    return int(text)


def int_range(text: str) -> tuple[int, int]:
    """``"100-1024"`` -> (100, 1024); a single number N is the range N-N."""
    low, _, high = text.partition("-")
    high = high or low
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def add_client_sampling_args(
    parser: argparse.ArgumentParser,
    description: str | None = None,
    *,
    temperature: float | None = None,
) -> None:
    """``CLIENT_SAMPLING_FLAGS`` as flags; unset ones are left to the request's defaults."""
    g = parser.add_argument_group("sampling", description)
    g.add_argument(
        "--max-tokens",
        type=positive_int,
        help="default 256, or what the model's context leaves after the prompt",
    )
    g.add_argument(
        "--temperature", type=float, default=temperature, help="0 = greedy (the default)"
    )
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument(
        "--structured-outputs", type=json_object, metavar="JSON", help=STRUCTURED_OUTPUTS_HELP
    )


def json_object(text: str) -> dict[str, Any]:
    """A flag's value that must be a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object {...}")
    return value


def client_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The client sampling flags that were given (or have a default)."""
    values = {name: getattr(args, name) for name in CLIENT_SAMPLING_FLAGS}
    return {name: value for name, value in values.items() if value is not None}


def int_list(text: str) -> tuple[int, ...]:
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected N,N,... got {text!r}")
    return values
