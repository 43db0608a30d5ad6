"""Protocol events to OpenAI bodies: whole completions, streamed chunks, usage, logprobs.

Finish reasons: ``stop`` and ``length`` are OpenAI's own; a request that reached its deadline
(``timeout``) was cut short by a limit, so it reads ``length``; one cancelled elsewhere
(``pagestream cancel``) ended on request, so it reads ``stop``.

Logprobs: the gateway has no tokenizer, so a token's text is known only when a token event
carries one token (the usual case: one token per engine step); otherwise, and for the
alternatives in ``top_logprobs``, a token reads ``token_id:N``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from clients.protocol import DoneEvent, FinishReason, RestartEvent, TokenEvent, TokenLogprob
from worker.gateway.openai_types import (
    AssistantMessage,
    ChatBody,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionBody,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageBody,
)
from worker.gateway.translate import Generation

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMEOUT: "length",
    FinishReason.CANCELLED: "stop",
}

_encode = msgspec.json.encode


@dataclass
class TokenText:
    """One output token: its text (as far as known) and its logprobs."""

    text: str
    logprob: TokenLogprob | None


def token_texts(event: TokenEvent) -> list[TokenText]:
    """The tokens of one event; see the module's note on their text."""
    logprobs = event.logprobs or [None] * len(event.token_ids)
    if len(event.token_ids) == 1:
        return [TokenText(event.text, logprobs[0])]
    return [
        TokenText(f"token_id:{t}", lp) for t, lp in zip(event.token_ids, logprobs, strict=False)
    ]


@dataclass
class Transcript:
    """The output so far (a ``restart`` event forgets it: the request runs again)."""

    text: str = ""
    tokens: list[TokenText] = field(default_factory=list)

    def add(self, event: TokenEvent | RestartEvent) -> None:
        if isinstance(event, RestartEvent):
            self.text, self.tokens = "", []
            return
        self.text += event.text
        self.tokens += token_texts(event)


def usage_body(done: DoneEvent) -> UsageBody:
    usage = done.usage
    return UsageBody(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(usage.cached_prompt_tokens),
    )


def _alternative_text(token_id: int, chosen: TokenText) -> str:
    assert chosen.logprob is not None
    return chosen.text if token_id == chosen.logprob.token_id else f"token_id:{token_id}"


def completion_logprobs(tokens: list[TokenText], text_start: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_start
    for token in tokens:
        lp = token.logprob
        out.tokens.append(token.text)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(
            None if lp is None else {_alternative_text(t, token): v for t, v in lp.top}
        )
        out.text_offset.append(offset)
        offset += 0 if token.text.startswith("token_id:") else len(token.text)
    return out


def _bytes(text: str) -> list[int] | None:
    return None if text.startswith("token_id:") else list(text.encode())


def chat_logprobs(tokens: list[TokenText]) -> ChatLogprobs:
    content = []
    for token in tokens:
        lp = token.logprob
        if lp is None:
            continue
        top = [TopLogprob(text, v, _bytes(text))
               for text, v in ((_alternative_text(t, token), v) for t, v in lp.top)]  # fmt: skip
        content.append(ChatTokenLogprob(token.text, lp.logprob, _bytes(token.text), top))
    return ChatLogprobs(content)


class ResponseBuilder:
    """Bodies of one generation, whole or streamed, as JSON bytes."""

    def __init__(self, generation: Generation, model: str) -> None:
        self.generation = generation
        self.model = model
        self._text_offset = 0

    # -- streamed -----------------------------------------------------------------------------

    def opening_chunks(self) -> list[bytes]:
        """Chat streams begin with the assistant's role, as OpenAI's do."""
        if not self.generation.is_chat:
            return []
        return [self._chat_chunk(ChatDelta(role="assistant", content=""))]

    def token_chunk(self, event: TokenEvent) -> bytes:
        tokens = token_texts(event) if self.generation.logprobs is not None else []
        if self.generation.is_chat:
            logprobs = chat_logprobs(tokens) if tokens else None
            return self._chat_chunk(ChatDelta(content=event.text), logprobs)
        completion_lp = None
        if tokens:
            completion_lp = completion_logprobs(tokens, self._text_offset)
        self._text_offset += len(event.text)
        return self._completion_chunk(CompletionChoice(event.text, logprobs=completion_lp))

    def closing_chunks(self, done: DoneEvent) -> list[bytes]:
        """The chunk with the finish reason, then (``include_usage``) the usage chunk."""
        reason = FINISH_REASONS[done.finish_reason]
        if self.generation.is_chat:
            chunks = [self._chat_chunk(ChatDelta(), finish_reason=reason)]
        else:
            chunks = [self._completion_chunk(CompletionChoice("", finish_reason=reason))]
        if self.generation.include_usage:
            chunks.append(self._usage_chunk(usage_body(done)))
        return chunks

    def _chat_chunk(
        self,
        delta: ChatDelta,
        logprobs: ChatLogprobs | None = None,
        finish_reason: str | None = None,
    ) -> bytes:
        choice = ChatChunkChoice(delta, logprobs=logprobs, finish_reason=finish_reason)
        return _encode(self._chat_envelope([choice]))

    def _chat_envelope(self, choices: list[ChatChunkChoice]) -> ChatChunk:
        g = self.generation
        return ChatChunk(id=g.request_id, created=g.created, model=self.model, choices=choices)

    def _completion_chunk(self, choice: CompletionChoice) -> bytes:
        return _encode(self._completion_envelope([choice]))

    def _completion_envelope(self, choices: list[CompletionChoice]) -> CompletionBody:
        g = self.generation
        return CompletionBody(id=g.request_id, created=g.created, model=self.model, choices=choices)

    def _usage_chunk(self, usage: UsageBody) -> bytes:
        if self.generation.is_chat:
            chat = self._chat_envelope([])
            chat.usage = usage
            return _encode(chat)
        completion = self._completion_envelope([])
        completion.usage = usage
        return _encode(completion)

    # -- whole ---------------------------------------------------------------------------------

    def body(self, transcript: Transcript, done: DoneEvent) -> bytes:
        """The whole response of a request that was not streamed."""
        g = self.generation
        reason = FINISH_REASONS[done.finish_reason]
        with_logprobs = g.logprobs is not None
        if g.is_chat:
            chat_lp = chat_logprobs(transcript.tokens) if with_logprobs else None
            choice = ChatChoice(AssistantMessage(transcript.text), logprobs=chat_lp,
                                finish_reason=reason)  # fmt: skip
            return _encode(ChatBody(id=g.request_id, created=g.created, model=self.model,
                                    choices=[choice], usage=usage_body(done)))  # fmt: skip
        completion_lp = completion_logprobs(transcript.tokens) if with_logprobs else None
        text_choice = CompletionChoice(
            transcript.text, logprobs=completion_lp, finish_reason=reason
        )
        body = self._completion_envelope([text_choice])
        body.usage = usage_body(done)
        return _encode(body)
