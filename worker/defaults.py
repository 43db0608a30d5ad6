"""Sampling defaults shared by the commands and the batch jobs of the service."""

from __future__ import annotations

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.0  # greedy: the same prompt gives the same text every run
