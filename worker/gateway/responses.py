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
from worker.gateway.chat_output import ChatParts, ChoiceReader
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
    FunctionCall,
    PromptTokensDetails,
    ToolCallBody,
    TopLogprob,
    UsageBody,
)
from worker.gateway.tool_parsers import ToolCallDelta
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
    """One choice's output so far (a ``restart`` event forgets it: the request runs again)."""

    text: str = ""
    tokens: list[TokenText] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # a sample's own (n > 1)

    def add(self, event: TokenEvent | RestartEvent) -> None:
        if isinstance(event, RestartEvent):
            self.text, self.tokens, self.finish_reason = "", [], None
            return
        self.text += event.text
        self.tokens += token_texts(event)
        self.finish_reason = event.finish_reason or self.finish_reason


@dataclass
class Transcripts:
    """Every choice's output so far, by index."""

    choices: dict[int, Transcript] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not any(t.tokens for t in self.choices.values())

    def add(self, event: TokenEvent | RestartEvent) -> None:
        if isinstance(event, RestartEvent):
            self.choices.clear()
            return
        self.choices.setdefault(event.index, Transcript()).add(event)

    def of(self, index: int) -> Transcript:
        return self.choices.get(index) or Transcript()


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
        self._text_offsets: dict[int, int] = {}
        self._readers: dict[int, ChoiceReader] = {}

    def _reader(self, index: int) -> ChoiceReader:
        reader = self._readers.get(index)
        if reader is None:
            reader = self._readers[index] = self.generation.chat_format.reader()
        return reader

    # -- streamed -----------------------------------------------------------------------------

    def opening_chunks(self) -> list[bytes]:
        """Chat streams begin with the assistant's role (for each choice), as OpenAI's do."""
        if not self.generation.is_chat:
            return []
        return [
            self._chat_chunk(index, ChatDelta(role="assistant", content=""))
            for index in range(self.generation.n)
        ]

    def token_chunks(self, event: TokenEvent) -> list[bytes]:
        """The chunks of one token event; the end of its choice too, when it carries one."""
        tokens = token_texts(event) if self.generation.logprobs is not None else []
        index = event.index
        if self.generation.is_chat:
            reader = self._reader(index)
            parts = reader.feed(event.text)
            if event.finish_reason is not None:
                parts.add(reader.flush())
            chunks = self._chat_part_chunks(index, parts, chat_logprobs(tokens) if tokens else None)
            if event.finish_reason is not None:
                reason = reader.finish_reason(FINISH_REASONS[event.finish_reason])
                chunks.append(self._chat_chunk(index, ChatDelta(), finish_reason=reason))
            return chunks
        completion_lp = None
        offset = self._text_offsets.get(index, 0)
        if tokens:
            completion_lp = completion_logprobs(tokens, offset)
        self._text_offsets[index] = offset + len(event.text)
        end = None if event.finish_reason is None else FINISH_REASONS[event.finish_reason]
        choice = CompletionChoice(event.text, index, completion_lp, end)
        return [self._completion_chunk(choice)]

    def closing_chunks(self, done: DoneEvent) -> list[bytes]:
        """The chunk with the finish reason (one choice; with several, each choice's came with
        its last token event), then (``include_usage``) the usage chunk."""
        chunks = []
        if self.generation.n == 1:
            reason = FINISH_REASONS[done.finish_reason]
            if self.generation.is_chat:
                reader = self._reader(0)
                chunks += self._chat_part_chunks(0, reader.flush(), None)
                reason = reader.finish_reason(reason)
                chunks.append(self._chat_chunk(0, ChatDelta(), finish_reason=reason))
            else:
                chunks.append(self._completion_chunk(CompletionChoice("", finish_reason=reason)))
        if self.generation.include_usage:
            chunks.append(self._usage_chunk(usage_body(done)))
        return chunks

    def _chat_part_chunks(
        self, index: int, parts: ChatParts, logprobs: ChatLogprobs | None
    ) -> list[bytes]:
        """A delta for the text parts (with the event's logprobs), then one per tool-call
        piece, as OpenAI streams them."""
        chunks = []
        if parts.reasoning or parts.content or not parts.tool_calls or logprobs is not None:
            has_text = bool(parts.reasoning or parts.content)
            delta = ChatDelta(content=parts.content if parts.content or not has_text else None,
                              reasoning_content=parts.reasoning or None)  # fmt: skip
            if has_text or logprobs is not None or self.generation.chat_format.is_plain:
                chunks.append(self._chat_chunk(index, delta, logprobs))
        for piece in parts.tool_calls:
            body = _tool_call_piece(piece)
            chunks.append(self._chat_chunk(index, ChatDelta(tool_calls=[body])))
        return chunks

    def _chat_chunk(
        self,
        index: int,
        delta: ChatDelta,
        logprobs: ChatLogprobs | None = None,
        finish_reason: str | None = None,
    ) -> bytes:
        choice = ChatChunkChoice(delta, index, logprobs=logprobs, finish_reason=finish_reason)
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

    def body(self, transcripts: Transcripts, done: DoneEvent) -> bytes:
        """The whole response of a request that was not streamed."""
        g = self.generation
        if g.is_chat:
            chat_choices = [self._chat_choice(i, transcripts.of(i), done) for i in range(g.n)]
            return _encode(ChatBody(id=g.request_id, created=g.created, model=self.model,
                                    choices=chat_choices, usage=usage_body(done)))  # fmt: skip
        choices = [self._completion_choice(i, transcripts.of(i), done) for i in range(g.n)]
        body = self._completion_envelope(choices)
        body.usage = usage_body(done)
        return _encode(body)

    def _finish_reason(self, transcript: Transcript, done: DoneEvent) -> str:
        return FINISH_REASONS[transcript.finish_reason or done.finish_reason]

    def _completion_choice(
        self, index: int, transcript: Transcript, done: DoneEvent
    ) -> CompletionChoice:
        with_logprobs = self.generation.logprobs is not None
        completion_lp = completion_logprobs(transcript.tokens) if with_logprobs else None
        reason = self._finish_reason(transcript, done)
        return CompletionChoice(transcript.text, index, completion_lp, reason)

    def _chat_choice(self, index: int, transcript: Transcript, done: DoneEvent) -> ChatChoice:
        g = self.generation
        chat_lp = chat_logprobs(transcript.tokens) if g.logprobs is not None else None
        reader = g.chat_format.reader()
        parts = reader.feed(transcript.text)
        parts.add(reader.flush())
        message = AssistantMessage(parts.content)
        if g.chat_format.reasoning_parser is not None:
            message.reasoning_content = parts.reasoning or None
        if reader.calls:
            message.content = parts.content or None  # without the whitespace after the calls
            message.tool_calls = [
                ToolCallBody(call.id, "function", FunctionCall(call.name, call.arguments))
                for call in reader.calls
            ]
        reason = reader.finish_reason(self._finish_reason(transcript, done))
        return ChatChoice(message, index, logprobs=chat_lp, finish_reason=reason)


def _tool_call_piece(piece: ToolCallDelta) -> ToolCallBody:
    """OpenAI's streamed piece of a call: the first names it, the others add arguments."""
    if piece.id is not None:
        function = FunctionCall(piece.name, piece.arguments)
        return ToolCallBody(piece.id, "function", function, index=piece.index)
    return ToolCallBody(function=FunctionCall(arguments=piece.arguments), index=piece.index)
