"""Structured outputs through the engine: every output parses and matches its constraint.

A tiny random llama over SmolLM2's real byte-level vocabulary (tests/structured_fixtures.py):
its choices are noise, so only the grammar's masks make the outputs valid. Greedy and sampled
rows, under preemption, prefix caching, chunked prefill, asynchronous scheduling and
speculative decoding.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from engine import LLM, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.structured import StructuredOutputs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{3}( [A-Z]{1,3})?"
GRAMMAR_LARK = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,3}/'
GRAMMAR_GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
CHOICES = ("alpha", "beta", "gamma delta")
PROMPTS = ["Describe a pet as JSON:", "hello", '{"name":"ab","age":3}', "x y z", "Reply."]
MAX_TOKENS = 64
SETTINGS: dict[str, Any] = dict(device="cpu", max_model_len=512)
# 16 pages of 8 tokens for 10 requests of up to ~32 + 64 tokens: preemption must happen
TIGHT: dict[str, Any] = dict(
    device="cpu", pa_block_size=8, pa_context_len=128, max_model_len=128, max_seqs=8,
    max_batched_tokens=48, prefill_chunk=16,
)  # fmt: skip


def structured(**kind: Any) -> StructuredOutputs:
    if isinstance(kind.get("json_schema"), dict):
        kind["json_schema"] = json.dumps(kind["json_schema"])
    return StructuredOutputs(**kind)


def params(kind: StructuredOutputs, count: int, **extra: Any) -> list[SamplingParams]:
    """Greedy and sampled (seeded, temperature 1.0 and 1.5) rows, alternating."""
    temperatures = [0.0, 1.0, 1.5]
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=temperatures[i % 3],
            seed=i,
            structured=kind,
            **extra,
        )
        for i in range(count)
    ]


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def llm(smollm2_vocab_model: Path) -> LLM:
    return LLM(str(smollm2_vocab_model), **SETTINGS)


def test_every_json_output_validates_against_its_schema(llm: LLM) -> None:
    outs = llm.generate(
        PROMPTS + PROMPTS[:1], params(structured(json_schema=SCHEMA), 6), use_tqdm=False
    )
    for out in outs:
        assert out.finish_reason is not None and out.finish_reason.value == "stop", out.text
        check_json(out.text)
    assert len({out.text for out in outs}) > 2  # sampled rows differ: not one memorised answer


@pytest.mark.parametrize(
    ("kind", "check"),
    [
        (structured(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
        (
            structured(grammar=GRAMMAR_LARK),
            lambda text: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", text),
        ),
        (structured(grammar=GRAMMAR_GBNF), lambda text: re.fullmatch(r"yes|no|maybe [0-9]", text)),
        (structured(choice=CHOICES), lambda text: text in CHOICES),
    ],
    ids=["regex", "lark", "gbnf", "choice"],
)
def test_every_output_matches_its_regex_grammar_or_choice(
    llm: LLM, kind: StructuredOutputs, check: Any
) -> None:
    outs = llm.generate(PROMPTS, params(kind, len(PROMPTS)), use_tqdm=False)
    for out in outs:
        assert check(out.text), out.text
        assert out.finish_reason is not None and out.finish_reason.value == "stop"


def test_json_object_outputs_are_objects(llm: LLM) -> None:
    # Nothing bounds an object's size: a noisy model may still be writing at max_tokens
    outs = llm.generate(PROMPTS[:4], params(structured(json_object=True), 4), use_tqdm=False)
    finished = [out.text for out in outs if out.finish_reason.value == "stop"]
    assert len(finished) >= 2
    assert all(isinstance(json.loads(text), dict) for text in finished)
    assert all(out.text.startswith("{") for out in outs)


def test_penalties_under_a_grammar_count_the_tokens_before_the_step(llm: LLM) -> None:
    """A row with a grammar is sampled late, when its output already holds the step's
    placeholder: its penalties count the tokens before it, as an unconstrained row's do (a
    grammar that allows anything then changes nothing; the placeholder once crashed it)."""
    penalties: dict[str, Any] = dict(
        max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=3.0,
        presence_penalty=2.0, frequency_penalty=1.0,
    )  # fmt: skip
    prompts = ["hello", "x y z", "Reply."]
    free = llm.generate(prompts, SamplingParams(**penalties), use_tqdm=False)
    anything = structured(regex=r"[\s\S]{0,400}")
    constrained = llm.generate(
        prompts, SamplingParams(**penalties, structured=anything), use_tqdm=False
    )
    unpenalized = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                       ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert any(a.token_ids != b.token_ids for a, b in zip(free, unpenalized, strict=True))
    for f, c in zip(free, constrained, strict=True):
        # (the grammar may end the text at a token its regex accepts as the end)
        assert len(c.token_ids) >= 8 and c.token_ids == f.token_ids[: len(c.token_ids)]


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = llm.generate(
        PROMPTS[:2] * 2, [free, free, *params(structured(choice=CHOICES), 2)], use_tqdm=False
    )
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]  # masks stay put
    assert all(o.text in CHOICES for o in mixed[2:])


def test_a_grammar_is_compiled_once_and_reused(llm: LLM) -> None:
    grammars = llm.engine.grammars
    kind = structured(regex="[0-9]{4}")
    llm.generate(["a"], params(kind, 1), use_tqdm=False)
    before = grammars.num_compiled
    outs = llm.generate(["b", "c"], params(kind, 2), use_tqdm=False)
    assert grammars.num_compiled == before
    assert all(re.fullmatch("[0-9]{4}", o.text) for o in outs)


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        (structured(json_schema={"type": "frobnicate"}), "structured_outputs.json_schema"),
        (structured(regex="(unclosed"), "structured_outputs.regex"),
        (structured(grammar="start: missing_rule"), "structured_outputs.grammar"),
    ],
    ids=["schema", "regex", "grammar"],
)
def test_an_uncompilable_constraint_refuses_only_its_request(
    smollm2_vocab_model: Path, llm: LLM, kind: StructuredOutputs, field: str
) -> None:
    engine = llm.engine
    engine.add_request("good", "hello", sampling=params(structured(choice=CHOICES), 1)[0])
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("bad", "hello", sampling=params(kind, 1)[0])
    assert refused.value.field == field and "cannot be compiled" in refused.value.message
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
    assert texts.keys() == {"good"} and texts["good"] in CHOICES


def test_constraint_settings_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputs(json_schema="{nope")
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutputs(regex="a+"))
    with pytest.raises(InvalidRequestError, match="unknown field"):
        StructuredOutputs.from_dict({"json": "{}"})


def run_engine(
    model: Path, prompts: list[str], sampling: list[SamplingParams], **settings: Any
) -> tuple[list[str], LLMEngine]:
    """Every request's text, stepping one engine to the end and checking its pages."""
    engine = LLMEngine(EngineConfig(model=str(model), **settings))
    texts = {}
    for index, (prompt, params_) in enumerate(zip(prompts, sampling, strict=True)):
        texts[f"r{index}"] = ""
        engine.add_request(f"r{index}", prompt, sampling=params_)
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.text_delta
        engine.block_manager.check_invariants(engine.scheduler.running)
    return list(texts.values()), engine


def test_outputs_stay_valid_under_preemption_prefix_caching_and_chunked_prefill(
    smollm2_vocab_model: Path, llm: LLM
) -> None:
    shared = "A shared system prompt that spans several pages of the cache. " * 2
    prompts = [shared + p for p in PROMPTS * 2]
    sampling = params(structured(json_schema=SCHEMA), len(prompts))
    texts, engine = run_engine(smollm2_vocab_model, prompts, sampling, **TIGHT)
    for text in texts:
        check_json(text)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0
    # greedy rows (every third) come out as they do with room to spare
    roomy = llm.generate(prompts[::3], sampling[::3], use_tqdm=False)
    assert texts[::3] == [o.text for o in roomy]


def test_asynchronous_scheduling_gives_the_same_outputs(
    smollm2_vocab_model: Path, llm: LLM
) -> None:
    sampling = params(structured(json_schema=SCHEMA), len(PROMPTS))
    texts, engine = run_engine(
        smollm2_vocab_model, PROMPTS, sampling, async_scheduling=True, **SETTINGS
    )
    sync = llm.generate(PROMPTS, sampling, use_tqdm=False)
    assert texts == [o.text for o in sync]  # seeded rows too: same draws, same masks
    # the masks were filled on their thread while the step before was taken in
    assert engine.runner.grammar_masks.num_started > 0


def test_speculative_drafts_are_checked_against_the_grammar(
    smollm2_vocab_model: Path, llm: LLM
) -> None:
    # JSON in the prompt: prompt lookup drafts keys and punctuation, some right, some not
    prompts = ['{"name":"ab","age":3,"tags":["a"],"kind":"cat"} ' * 2 + p for p in PROMPTS]
    sampling = params(structured(json_schema=SCHEMA), len(prompts))
    texts, engine = run_engine(
        smollm2_vocab_model, prompts, sampling, speculative="ngram", num_speculative_tokens=4,
        **SETTINGS,
    )  # fmt: skip
    for text in texts:
        check_json(text)
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    plain = llm.generate(prompts[::3], sampling[::3], use_tqdm=False)
    assert texts[::3] == [o.text for o in plain]  # greedy: drafts change nothing


def test_a_steps_masks_allow_exactly_what_the_grammar_accepts(llm: LLM) -> None:
    from engine.structured.masks import GrammarMasks, MaskedRow
    from kernels.sampling.token_bitmask import unpack_bitmask_ref

    grammars, tokenizer = llm.engine.grammars, llm.engine.tokenizer
    vocab_size = llm.engine.loaded.arch.vocab_size
    plain = grammars.matcher_for(structured(json_schema=SCHEMA))
    drafted = grammars.matcher_for(structured(json_schema=SCHEMA))
    drafts = tokenizer.encode('{"name":"', add_special_tokens=False)
    rows = [MaskedRow(0, plain, []), MaskedRow(3, drafted, drafts)]
    bitmask, row_index = GrammarMasks(vocab_size, torch.device("cpu")).fill(rows)
    assert row_index.tolist() == [0, *range(3, 3 + len(drafts) + 1)]
    allowed = unpack_bitmask_ref(bitmask, vocab_size)
    assert drafted.num_valid(drafts) == len(drafts)  # the fill rolled its drafts back
    probe = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:300].tolist()
    for position in range(len(drafts) + 1):
        for token in {*probe, *allowed[1 + position].nonzero().flatten().tolist()[:50]}:
            accepted = drafted.num_valid([*drafts[:position], token]) == position + 1
            assert bool(allowed[1 + position, token]) == accepted, (position, token)
    assert torch.equal(allowed[0], allowed[1])  # both at the start of the same schema


def test_a_fill_started_for_another_step_is_dropped_and_the_masks_filled_anew(llm: LLM) -> None:
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence
    from engine.structured.masks import GrammarMasks

    grammars, tokenizer = llm.engine.grammars, llm.engine.tokenizer
    vocab_size = llm.engine.loaded.arch.vocab_size

    def entries(prefix: str) -> list[ScheduledSeq]:
        grammar = grammars.matcher_for(structured(json_schema=SCHEMA))
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert grammar.accept(token)
        seq = Sequence("r", [1], SamplingParams(), 0.0, grammar=grammar)
        return [ScheduledSeq(seq, 1)]

    started, applied = entries(""), entries('{"name":"')
    masks = GrammarMasks(vocab_size, torch.device("cpu"), num_threads=2)
    masks.start(started, [])  # a step that then failed before its sampling
    logits = torch.zeros(1, vocab_size)
    masks.apply(logits, applied, [])
    expected = torch.zeros(1, vocab_size)
    GrammarMasks(vocab_size, torch.device("cpu")).apply(expected, applied, [])
    assert torch.equal(logits, expected) and logits.isinf().any()
    assert masks.num_started == 1 and masks.num_fills == 1
    assert started[0].seq.grammar is not None and started[0].seq.grammar.is_usable  # let go


@pytest.fixture(scope="module")
def noisy_draft(smollm2_vocab_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model with noise on every weight: a draft that is often, not always, right."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_vocab_model, dtype=torch.float32)
    torch.manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    directory = tmp_path_factory.mktemp("smollm2-vocab-draft")
    model.save_pretrained(directory)
    return directory


def test_a_draft_model_drafts_under_the_grammar(
    smollm2_vocab_model: Path, noisy_draft: Path, llm: LLM
) -> None:
    sampling = params(structured(json_schema=SCHEMA), len(PROMPTS))
    texts, engine = run_engine(
        smollm2_vocab_model, PROMPTS, sampling, speculative_model=str(noisy_draft),
        num_speculative_tokens=3, **SETTINGS,
    )  # fmt: skip
    for text in texts:
        check_json(text)
    # the draft model drafts under the grammar too (free drafts over this noisy vocabulary
    # would nearly all leave it): close to the target's own choices, often accepted
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    plain = llm.generate(PROMPTS[::3], sampling[::3], use_tqdm=False)
    assert texts[::3] == [o.text for o in plain]  # greedy: drafts change nothing


def test_the_grammar_cache_drops_the_least_recently_used(llm: LLM) -> None:
    from engine.structured.grammars import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(
        engine.tokenizer, engine.loaded.arch.vocab_size, engine.eos_token_ids, max_cached=2
    )
    first, second, third = (structured(regex=f"[0-9]{{{n}}}") for n in (1, 2, 3))
    for kind in (first, second, first, third):  # first is used again before third comes
        compiler.matcher_for(kind)
    assert compiler.num_compiled == 3
    compiler.matcher_for(first)  # kept: second was the least recently used
    assert compiler.num_compiled == 3
    compiler.matcher_for(second)
    assert compiler.num_compiled == 4
    matcher = compiler.matcher_for(third)  # a fresh copy: at the start of its grammar
    digits = engine.tokenizer.encode("123", add_special_tokens=False)
    assert matcher.num_valid(digits) == len(digits)


def test_prebuilt_matchers_are_handed_out_each_at_the_start_of_its_grammar(llm: LLM) -> None:
    """``prebuild`` makes a batch's matchers on threads; ``matcher_for`` hands each out once,
    independent of the others, then compiles again; an uncompilable constraint is left to
    ``matcher_for`` to refuse."""
    from engine.structured.grammars import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(
        engine.tokenizer, engine.loaded.arch.vocab_size, engine.eos_token_ids
    )
    digits, bad = structured(regex="[0-9]{3}"), structured(regex="(unclosed")
    compiler.prebuild([digits, digits, digits, bad])
    assert compiler.num_compiled == 1  # the grammar text, made once
    matchers = [compiler.matcher_for(digits) for _ in range(3)]
    assert len({id(m.matcher) for m in matchers}) == 3
    tokens = engine.tokenizer.encode("123", add_special_tokens=False)
    assert all(matchers[0].accept(token) for token in tokens)  # the others stay at the start
    assert all(matcher.num_valid(tokens) == len(tokens) for matcher in matchers[1:])
    assert compiler.num_prebuilt == 0
    compiler.matcher_for(digits)  # the pool is empty: a new one, from the cached grammar text
    assert compiler.num_compiled == 1
    with pytest.raises(InvalidRequestError):
        compiler.matcher_for(bad)


def test_matchers_built_ahead_for_one_request_are_taken_by_it(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build_ahead`` (a worker's compile off its loop) keeps one matcher per sample, which
    ``matcher_for`` hands out without compiling; an uncompilable constraint raises there and
    keeps nothing; with the pool full it only checks."""
    import engine.structured.grammars as grammars_module
    from engine.structured.grammars import GrammarCompiler

    engine = llm.engine
    compiler = GrammarCompiler(
        engine.tokenizer, engine.loaded.arch.vocab_size, engine.eos_token_ids
    )
    digits = structured(regex="[0-9]{3}")
    compiler.build_ahead(digits, count=2)
    assert compiler.num_prebuilt == 2
    made = []
    monkeypatch.setattr(compiler, "_new_matcher", lambda *args: made.append(args))
    first, second = compiler.matcher_for(digits), compiler.matcher_for(digits)
    assert made == [] and first.matcher is not second.matcher  # both ready, each its own
    assert compiler.num_prebuilt == 0
    monkeypatch.undo()
    with pytest.raises(InvalidRequestError):
        compiler.build_ahead(structured(regex="(unclosed"))
    assert compiler.num_prebuilt == 0
    monkeypatch.setattr(grammars_module, "MAX_PREBUILT_MATCHERS", 1)
    compiler.build_ahead(digits, count=3)  # room for one
    compiler.build_ahead(digits)  # none: compiled to check, not kept
    assert compiler.num_prebuilt == 1


def test_a_batch_makes_its_matchers_ahead_and_every_output_is_valid(llm: LLM) -> None:
    grammars = llm.engine.grammars
    kind = structured(regex="[a-z]{2}[0-9]{2}")
    outs = llm.generate(["x", "y", "z"], params(kind, 3), use_tqdm=False)
    assert all(re.fullmatch("[a-z]{2}[0-9]{2}", o.text) for o in outs)
    assert grammars.num_prebuilt == 0  # all three handed out


def test_many_rows_take_their_tokens_together_as_one_by_one(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From PAR_ACCEPT_MIN_ROWS rows a step's grammars take their tokens in one call on
    llguidance's pool: the same outputs as taking them one call a row."""
    from engine.structured.grammars import accept_one_by_one
    from engine.structured.masks import PAR_ACCEPT_MIN_ROWS

    prompts = (PROMPTS * 5)[:20]
    sampling = params(structured(json_schema=SCHEMA), len(prompts))
    outputs = llm.engine.outputs
    together = outputs.accept_tokens
    batch_sizes: list[int] = []

    def recorded(pairs: list[Any]) -> list[bool]:
        batch_sizes.append(len(pairs))
        return together(pairs)

    monkeypatch.setattr(outputs, "accept_tokens", recorded)
    pooled = [out.text for out in llm.generate(prompts, sampling, use_tqdm=False)]
    assert max(batch_sizes) >= PAR_ACCEPT_MIN_ROWS  # the pool's path ran
    monkeypatch.setattr(outputs, "accept_tokens", accept_one_by_one)
    assert pooled == [out.text for out in llm.generate(prompts, sampling, use_tqdm=False)]
    for text in pooled:
        check_json(text)


def test_reused_host_buffers_give_the_masks_of_fresh_ones(llm: LLM) -> None:
    """A GrammarMasks keeps its host buffers from step to step (two in turn, grown as needed):
    across growing and shrinking row counts, with drafts, its masks are those of a fresh one."""
    from engine.structured.masks import GrammarMasks, MaskedRow

    grammars, tokenizer = llm.engine.grammars, llm.engine.tokenizer
    assert tokenizer is not None
    vocab_size = llm.engine.loaded.arch.vocab_size
    prefixes = ["", '{"name":"', '{"name":"ab","age":1', '{"name":"a","age":2,"tags":["']
    matchers = []
    for prefix in prefixes * 20:
        grammar = grammars.matcher_for(structured(json_schema=SCHEMA))
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert grammar.accept(token)
        matchers.append(grammar)
    drafts = tokenizer.encode('{"name":"', add_special_tokens=False)
    reused = GrammarMasks(vocab_size, torch.device("cpu"), num_threads=2)
    for num_rows in (3, 80, 5, 70, 1):  # past the first buffers' 64 masks, and back
        rows = [MaskedRow(2 * i, matchers[i], []) for i in range(num_rows)]
        rows.append(MaskedRow(2 * num_rows, matchers[0], drafts))  # at the start: drafts fit
        bitmask, row_index = reused.fill(rows)
        expected, expected_index = GrammarMasks(vocab_size, torch.device("cpu")).fill(rows)
        assert torch.equal(row_index, expected_index) and torch.equal(bitmask, expected)
        assert len(row_index) == num_rows + len(drafts) + 1
        logits = torch.zeros(num_rows, vocab_size)  # the same steps through apply
        fresh_logits = logits.clone()
        entries = _entries_of(rows[:-1])  # sampling row i: matchers[i]
        reused.apply(logits, entries, [])
        GrammarMasks(vocab_size, torch.device("cpu")).apply(fresh_logits, entries, [])
        assert torch.equal(logits, fresh_logits) and logits.isinf().any()


def _entries_of(rows: list[Any]) -> list[Any]:
    """Sampling entries whose sequences hold ``rows``' grammars, one row each, in order."""
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence

    return [
        ScheduledSeq(Sequence(f"r{i}", [1], SamplingParams(), 0.0, grammar=row.grammar), 1)
        for i, row in enumerate(rows)
    ]
