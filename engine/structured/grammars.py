"""Grammars for one tokenizer: each constraint's grammar made once (LRU-cached), one matcher per
sequence that advances with each accepted token.

Built on llguidance (docs/structured-outputs.md says why): a constraint's grammar text is made
once and cached; each request compiles its own matcher from it (about half a millisecond for
a typical JSON schema).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.errors import ConfigError, InvalidRequestError
from engine.structured.params import FIELD, StructuredOutputs
from engine.structured.tokenizers import grammar_tokenizer

MAX_CACHED_GRAMMARS = 512  # compiled constraints kept (least recently used dropped first)
MAX_PREBUILT_MATCHERS = 4096  # fresh matchers made ahead of their requests (``prebuild``)
MAX_PREBUILD_THREADS = 16  # matchers made at once: each releases the GIL while it compiles
# JSON as OpenAI's strict mode writes it: compact, no free whitespace between tokens (a model
# that may put whitespace anywhere can also fill max_tokens with it)
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # an llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it here."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""
        return bool(self.matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete (more may follow)."""
        return bool(self.matcher.is_accepting())

    @property
    def is_usable(self) -> bool:
        """It can say what comes next (not ended, not failed)."""
        return not self.matcher.is_stopped() and not self.matcher.is_error()

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar allows from here (drafts to keep)."""
        return int(self.matcher.validate_tokens(list(token_ids)))

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same place (a draft model drafts on it)."""
        return GrammarMatcher(self.matcher.deep_copy())

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)


def accept_one_by_one(pairs: list[tuple[GrammarMatcher, int]]) -> list[bool]:
    """Each grammar takes its token, one call each (False: it refused it)."""
    return [grammar.accept(token_id) for grammar, token_id in pairs]


class GrammarCompiler:
    """Turns ``StructuredOutputs`` into ``GrammarMatcher``s for one model's tokenizer.

    Thread-safe: the engine calls ``matcher_for`` from ``add_request`` (on the caller's
    thread, off the step's path). The tokenizer's grammar view is built on first use (~1 s).

    Each matcher is built from the constraint's grammar (cached) with a lexer of its own:
    llguidance's ``LLMatcher.deep_copy`` shares the lexer with the original, behind a mutex
    that computing a mask holds, so copies of one matcher fill their masks one at a time
    however many threads fill them (docs/structured-outputs.md, "Why the fill did not scale").
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        # the grammar text of each constraint that compiled
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()
        # fresh matchers made ahead of their requests, by constraint (``prebuild``)
        self._prebuilt: dict[tuple[str, str], deque[Any]] = {}
        self._num_prebuilt = 0
        self.num_compiled = 0  # cache misses, for tests and stats

    @property
    def num_prebuilt(self) -> int:
        """Matchers made by ``prebuild`` or ``build_ahead`` that no request has taken yet."""
        return self._num_prebuilt

    def prebuild(self, constraints: Iterable[StructuredOutputs]) -> None:
        """Make a matcher for each of ``constraints`` (one per sample to come) on a pool of
        threads, for ``matcher_for`` to hand out: a batch of requests added one after another
        then waits for one compile at a time no more (about 1 ms each on a GPU host's CPU, 0.26
        s before the first step of 256 requests). A constraint that cannot be compiled is left
        for ``matcher_for`` to refuse; at most ``MAX_PREBUILT_MATCHERS`` wait at once."""
        todo = list(constraints)[: max(0, MAX_PREBUILT_MATCHERS - self._num_prebuilt)]
        if len(todo) < 2:
            return  # one compile: as cheap on the caller's thread
        try:
            self.tokenizer()  # built once, before the threads would each wait for it
        except ConfigError:
            return  # no grammar view of this model: matcher_for says so, per request

        def build(structured: StructuredOutputs) -> tuple[tuple[str, str], Any] | None:
            try:
                return structured.cache_key, self._compile(structured)
            except InvalidRequestError:
                return None

        # one of each constraint here first: its grammar text made (and counted) once
        firsts = {structured.cache_key: structured for structured in reversed(todo)}
        built = [result for result in map(build, firsts.values()) if result is not None]
        rest = list(todo)
        for structured in firsts.values():
            rest.remove(structured)
        if rest:
            with ThreadPoolExecutor(min(MAX_PREBUILD_THREADS, len(rest))) as pool:
                built += [result for result in pool.map(build, rest) if result is not None]
        self._keep(built)

    def build_ahead(self, structured: StructuredOutputs, count: int = 1) -> None:
        """Make ``count`` matchers of ``structured`` on this thread (one per sample to come),
        for ``matcher_for`` to hand out: a worker compiles a request's matchers off its event
        loop before adding it, so that adding it compiles nothing on the engine's thread.
        Raises ``InvalidRequestError`` when the constraint cannot be compiled. Past
        ``MAX_PREBUILT_MATCHERS`` waiting it compiles one, to check, and keeps none."""
        with self._lock:
            room = max(0, MAX_PREBUILT_MATCHERS - self._num_prebuilt)
        built = [self._compile(structured) for _ in range(max(1, min(count, room)))]
        if room:
            self._keep([(structured.cache_key, matcher) for matcher in built])

    def _keep(self, built: list[tuple[tuple[str, str], Any]]) -> None:
        with self._lock:
            for key, matcher in built:
                self._prebuilt.setdefault(key, deque()).append(matcher)
            self._num_prebuilt += len(built)

    def matcher_for(self, structured: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher; raises ``InvalidRequestError`` when the constraint cannot be
        compiled (the message is the library's). About half a millisecond for a JSON schema,
        with the GIL released; a constraint seen before skips the conversion to a grammar."""
        with self._lock:
            waiting = self._prebuilt.get(structured.cache_key)
            if waiting:
                self._num_prebuilt -= 1
                return GrammarMatcher(waiting.popleft())
        return GrammarMatcher(self._compile(structured))

    def _compile(self, structured: StructuredOutputs) -> Any:
        """A new ``llguidance.LLMatcher`` of the constraint, its grammar text cached."""
        key = structured.cache_key
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None:
                self._compiled.move_to_end(key)
        if grammar is not None:
            return self._new_matcher(structured, grammar)
        grammar = self._grammar(structured)  # outside the lock: other requests go on
        matcher = self._new_matcher(structured, grammar)
        with self._lock:
            self._compiled[key] = grammar
            self.num_compiled += 1
            while len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
        return matcher

    def tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` of the model (built once)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(
                    self.hf_tokenizer, self.vocab_size, self.eos_token_ids
                )
            return self._tokenizer

    def _grammar(self, structured: StructuredOutputs) -> str:
        try:
            return _grammar_text(structured)
        except ValueError as exc:
            kind = structured.kind
            raise InvalidRequestError(f"{FIELD}.{kind}", f"cannot be compiled: {exc}") from None

    def _new_matcher(self, structured: StructuredOutputs, grammar: str) -> Any:
        """An ``llguidance.LLMatcher`` of ``grammar``, its lexer its own."""
        import llguidance

        try:
            tokenizer = self.tokenizer()
        except ConfigError as exc:  # the model's, not the request's fault; still its error
            raise InvalidRequestError(FIELD, str(exc)) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"{FIELD}.{structured.kind}", f"cannot be compiled: {matcher.get_error()}"
            )
        return matcher


def _grammar_text(structured: StructuredOutputs) -> str:
    """llguidance's grammar for the constraint; raises ``ValueError`` for malformed input."""
    import llguidance

    if structured.json_schema is not None:
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(
                structured.json_schema, overrides=JSON_OPTIONS
            )
        )
    if structured.json_object:
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', overrides=JSON_OPTIONS
            )
        )
    if structured.regex is not None:
        return str(llguidance.LLMatcher.grammar_from_regex(structured.regex))
    if structured.grammar is not None:
        return str(llguidance.grammar_from("grammar", structured.grammar))  # Lark or GBNF
    assert structured.choice is not None
    return str(llguidance.grammar_from("choice", json.dumps(list(structured.choice))))
