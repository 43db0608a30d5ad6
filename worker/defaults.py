"""Sampling defaults shared by the commands and the batch jobs of the service."""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_TOKENS = 256  # fewer where the model's context ends first
DEFAULT_TEMPERATURE = 0.0  # greedy: the same prompt gives the same text every run


def with_default_max_tokens(
    sampling: dict[str, Any], default: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """``sampling`` (keyword arguments of ``SamplingParams``) with ``default`` when it sets no
    ``max_tokens``: lowered to what the context leaves after the prompt (``clamp_max_tokens``)
    rather than refused, as the user did not ask for it."""
    if sampling.get("max_tokens") is not None:
        return sampling
    return {"clamp_max_tokens": True, **sampling, "max_tokens": default}
