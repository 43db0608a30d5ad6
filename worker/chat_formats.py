"""The output formats a model's chat template teaches it, for the gateway's parsers.

A worker reports them in its heartbeat; the gateway's ``--tool-call-parser auto`` and
``--reasoning-parser auto`` take them. Detection reads the template's text: ``<tool_call>``
(Qwen2.5, Qwen3, Hermes templates) means ``hermes`` tool calls; ``<think>`` (Qwen3, QwQ)
means ``qwen3`` reasoning.
"""

from __future__ import annotations

from typing import Any

_TOOL_CALL_MARKERS = (("<tool_call>", "hermes"),)
_REASONING_MARKERS = (("<think>", "qwen3"),)


def detect_chat_formats(tokenizer: Any | None) -> tuple[str, str]:
    """(tool-call parser, reasoning parser) of ``tokenizer``'s chat template; "" where the
    template shows none (or there is no template)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: any of them counts
        template = "\n".join(str(text) for text in template.values())
    text = str(template)
    tool = next((name for marker, name in _TOOL_CALL_MARKERS if marker in text), "")
    reasoning = next((name for marker, name in _REASONING_MARKERS if marker in text), "")
    return tool, reasoning
