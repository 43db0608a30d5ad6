"""Constrained decoding: grammars compiled off the step's path, token masks applied to logits.

``StructuredOutputs`` (in ``SamplingParams.structured``) says what shape the output must take.
"""

from engine.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]
