"""``LLM``: offline batch generation over the same engine the worker drives."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.errors import InvalidRequestError
from engine.inputs import ChatTemplateOptions
from engine.llm_engine import LLMEngine, StepOutput
from engine.memory import gc_frozen
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Usage

Prompt = str | Seq[int]
Conversation = list[dict[str, Any]]


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's shape): ``index`` 0 unless it asked for n > 1."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs; None unless logprobs were asked for."""
        if not self.logprobs or any(lp is None for lp in self.logprobs):
            return None
        return sum(lp.logprob for lp in self.logprobs if lp is not None)


@dataclass
class RequestOutput:
    """A request's result: ``outputs`` holds its ``n`` samples, by index. ``text``,
    ``token_ids``, ``logprobs``, ``finish_reason`` and ``stop_reason`` are the first's;
    ``usage`` covers them all (the prompt counted once)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])
    usage: Usage | None = None
    time_to_first_token_s: float | None = None
    latency_s: float | None = None
    finished: bool = False

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    def add_step(self, step_out: StepOutput, elapsed_s: float) -> bool:
        """Fold one step's output in (``elapsed_s`` since submission); True once finished."""
        if step_out.new_token_ids and self.time_to_first_token_s is None:
            self.time_to_first_token_s = elapsed_s
        while len(self.outputs) <= step_out.index:
            self.outputs.append(CompletionOutput(len(self.outputs)))
        sample = self.outputs[step_out.index]
        sample.token_ids += step_out.new_token_ids
        sample.logprobs += step_out.logprobs
        sample.text += step_out.text_delta
        if step_out.sample_finished:
            sample.finish_reason = step_out.finish_reason
            sample.stop_reason = step_out.stop_reason
        if step_out.finished:
            self.usage = step_out.usage
            self.latency_s = elapsed_s
            self.finished = True
        return step_out.finished


class LLM:
    """Generate text for many prompts at once with continuous batching.

    >>> llm = LLM("smollm2-135m")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    >>> out[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, **settings: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **settings))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (nothing to do without them)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. A prompt is text or a list of token ids."""
        batch = _as_prompt_list(prompts)
        params = _broadcast(sampling_params, len(batch))
        requests = [
            {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in batch
        ]
        return self._run(requests, params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Seq[Conversation],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. ``tools``
        (OpenAI function definitions) and ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}``) go to the template."""
        is_single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if is_single else list(messages)
        params = _broadcast(sampling_params, len(conversations))
        template = ChatTemplateOptions(tools, chat_template_kwargs)
        requests = [
            {"messages": list(conversation), "template": template} for conversation in conversations
        ]
        return self._run(requests, params, use_tqdm)

    def _run(
        self, requests: list[dict[str, Any]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        outputs = self._add_all(requests, params)
        by_id = {out.request_id: out for out in outputs}
        start_s = time.perf_counter()
        with (
            tqdm(total=len(outputs), disable=not use_tqdm, desc="generate", unit="req") as bar,
            gc_frozen(),  # the engine's objects out of every full collection's walk
        ):
            num_tokens = 0
            while self.engine.has_unfinished_requests():
                for step_out in self.engine.step():
                    num_tokens += len(step_out.new_token_ids)
                    out = by_id[step_out.request_id]
                    if out.add_step(step_out, time.perf_counter() - start_s):
                        bar.update(1)
                elapsed_s = time.perf_counter() - start_s
                bar.set_postfix_str(f"{num_tokens / max(elapsed_s, 1e-9):.1f} tok/s", refresh=False)
        return outputs

    def _add_all(
        self, requests: list[dict[str, Any]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        # Encode and validate every request before any runs, so a bad one costs nothing.
        encoded = []
        for index, request in enumerate(requests):
            with _naming_request(index, len(requests)):
                encoded.append(self.engine.encode_prompt(**request))
        # every sample's grammar matcher made at once on a pool of threads, not one by one below
        self.engine.grammars.prebuild(
            sampling.structured
            for sampling in params
            if sampling.structured is not None
            for _ in range(sampling.num_samples)
        )
        outputs: list[RequestOutput] = []
        try:
            for index, (request, token_ids, sampling) in enumerate(
                zip(requests, encoded, params, strict=True)
            ):
                with _naming_request(index, len(requests)):  # max_tokens past the context, n
                    request_id = self.engine.add_request(
                        prompt_token_ids=token_ids, sampling=sampling
                    )
                outputs.append(RequestOutput(request_id, request.get("prompt"), token_ids))
        except BaseException:
            # none of the call's requests runs: the ones added are taken back, so that the
            # engine is left as it was for the next call
            for out in outputs:
                self.engine.abort(out.request_id)
            self._drain()
            raise
        return outputs

    def _drain(self) -> None:
        """Step the engine until it holds nothing (aborted requests leave at a step)."""
        while self.engine.has_unfinished_requests():
            self.engine.step()


@contextlib.contextmanager
def _naming_request(index: int, num_requests: int) -> Iterator[None]:
    """A refusal inside says which of the call's requests it is about (when it has several)."""
    try:
        yield
    except InvalidRequestError as exc:
        if num_requests == 1:
            raise
        raise InvalidRequestError(exc.field, f"request {index}: {exc.message}") from exc


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(x, int) for x in items):
        return [items]  # one prompt given as token ids
    return items


def _broadcast(
    params: SamplingParams | Seq[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(
            "sampling_params", f"{len(params)} given for {count} prompts; give one or one each"
        )
    return list(params)
