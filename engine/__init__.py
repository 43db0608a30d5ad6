"""pagestream's inference engine: paged KV cache, continuous batching, offline API."""

from engine.config import EngineConfig
from engine.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    PagestreamError,
    UnsupportedModelError,
)
from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.llm_engine import EngineStats, LLMEngine, StepOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Usage
from engine.structured import StructuredOutputs

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "PagestreamError",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
    "StructuredOutputs",
    "UnsupportedModelError",
    "Usage",
]
