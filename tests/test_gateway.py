"""The gateway through the official ``openai`` client: a real uvicorn, Redis and worker (tiny
model on the CPU). Greedy answers are checked against the same request through Redis."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from clients import Client
from tests.doc_examples import python_example
from tests.gateway_fixtures import API_KEY, CONTEXT_LEN, Stack

PROMPT_IDS = [5, 6, 7, 8]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0) as client:
        yield client


def redis_greedy(stack: Stack, max_tokens: int, **request: object) -> tuple[str, list[int]]:
    """The same greedy request through the bundled Redis client: the reference answer."""
    with Client(stack.redis.url) as redis_client:
        done = redis_client.complete(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                     timeout_s=60, **request)  # fmt: skip
    return done.text, done.token_ids


def test_models_lists_the_workers_model(client: openai.OpenAI, stack: Stack) -> None:
    assert [model.id for model in client.models.list()] == [stack.model]
    assert client.models.retrieve(stack.model).id == stack.model  # a path: slashes and all
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_whole_matches_the_redis_client(client: openai.OpenAI, stack: Stack) -> None:
    out = client.completions.create(model=stack.model, prompt=PROMPT_IDS, max_tokens=6,
                                    temperature=0, extra_body=IGNORE_EOS)  # fmt: skip
    text, _ = redis_greedy(stack, 6, token_ids=PROMPT_IDS)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 6)
    assert out.usage.total_tokens == 10


def test_completion_stream_with_usage(client: openai.OpenAI, stack: Stack) -> None:
    chunks = list(client.completions.create(
        model=stack.model, prompt=PROMPT_IDS, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
    ))  # fmt: skip
    text, _ = redis_greedy(stack, 6, token_ids=PROMPT_IDS)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage  # the last chunk: no choices, the usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 6


def test_chat_applies_the_template_streamed_and_not(client: openai.OpenAI, stack: Stack) -> None:
    messages = [{"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=5,
                                         temperature=0, extra_body=IGNORE_EOS)  # type: ignore[arg-type]  # fmt: skip
    # The template makes `w10 w5 w6 w11 w12`: the same answer as those token ids.
    text, _ = redis_greedy(stack, 5, token_ids=[10, 5, 6, 11, 12])
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert out.usage is not None and out.usage.prompt_tokens == 5
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=5, temperature=0,  # type: ignore[arg-type]
        stream=True, extra_body=IGNORE_EOS,
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, stack: Stack) -> None:
    text, _ = redis_greedy(stack, 8, token_ids=PROMPT_IDS)
    words = text.split()
    stop = words[3]
    out = client.completions.create(model=stack.model, prompt=PROMPT_IDS, max_tokens=8,
                                    temperature=0, stop=[stop], extra_body=IGNORE_EOS)  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text.split()
    assert out.choices[0].text.split() == words[: words.index(stop)]


def test_seed_makes_sampling_repeatable(client: openai.OpenAI, stack: Stack) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(model=stack.model, prompt=PROMPT_IDS, max_tokens=8,
                                        temperature=1.0, seed=seed, extra_body=IGNORE_EOS)  # fmt: skip
        return out.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_completion_logprobs(client: openai.OpenAI, stack: Stack) -> None:
    out = client.completions.create(model=stack.model, prompt=PROMPT_IDS, max_tokens=4,
                                    temperature=0, logprobs=2, extra_body=IGNORE_EOS)  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert " ".join(t.strip() for t in logprobs.tokens) == out.choices[0].text.strip()
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):  # fmt: skip
        assert logprob is not None and logprob <= 0
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob)  # greedy: the best
        assert token in top


def test_chat_logprobs(client: openai.OpenAI, stack: Stack) -> None:
    out = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "w7"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS,
    )  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())


def test_errors_have_openai_status_and_param(client: openai.OpenAI, stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad_n:
        client.completions.create(model=stack.model, prompt="w5", max_tokens=2, n=0)
    assert bad_n.value.status_code == 400 and bad_n.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="w5", max_tokens=2)
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
    too_long = [5] * (CONTEXT_LEN + 4)
    for stream in (False, True):  # refused before the first byte of a stream, too
        with pytest.raises(openai.BadRequestError) as long_prompt:
            client.completions.create(model=stack.model, prompt=too_long, max_tokens=2,
                                      stream=stream)  # fmt: skip
        body = long_prompt.value.body
        assert body["param"] == "prompt" and body["code"] == "context_length_exceeded"  # type: ignore[index]
        assert f"{CONTEXT_LEN + 4} tokens" in body["message"]  # type: ignore[index]


def test_max_tokens_past_the_context_is_400_before_any_token(
    client: openai.OpenAI, stack: Stack
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=stack.model, prompt=PROMPT_IDS,
                                      max_tokens=10_000_000, stream=stream)  # fmt: skip
        body = error.value.body
        assert body["param"] == "max_tokens" and body["code"] == "context_length_exceeded"  # type: ignore[index]
        assert (
            f"context is {CONTEXT_LEN} tokens; the prompt has {len(PROMPT_IDS)} and max_tokens "
            f"asks for 10000000 more: lower max_tokens to at most {CONTEXT_LEN - len(PROMPT_IDS)}"
        ) in body["message"]  # type: ignore[index]


def test_without_max_tokens_the_default_is_lowered_to_fit(
    client: openai.OpenAI, stack: Stack
) -> None:
    # /v1/completions defaults to 16 tokens: 8 fit after this prompt
    out = client.completions.create(model=stack.model, prompt=[5] * (CONTEXT_LEN - 8),
                                    extra_body=IGNORE_EOS)  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    # chat defaults to --chat-max-tokens (1024): what the context leaves after the template
    messages = [{"role": "user", "content": " ".join(["w5"] * (CONTEXT_LEN - 20))}]
    chat = client.chat.completions.create(model=stack.model, messages=messages,  # type: ignore[arg-type]
                                          extra_body=IGNORE_EOS)  # fmt: skip
    assert chat.usage is not None
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT_LEN
    assert chat.choices[0].finish_reason == "length"


def test_bad_or_missing_api_key_is_401(stack: Stack) -> None:
    wrong = openai.OpenAI(base_url=stack.base_url, api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError) as exc:
        wrong.models.list()
    assert exc.value.status_code == 401
    assert exc.value.body["code"] == "invalid_api_key"  # type: ignore[index]


@pytest.mark.parametrize("doc", ["README.md", "docs/gateway.md"])
def test_the_openai_example_runs(
    doc: str, stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``openai`` example of the README and of docs/gateway.md, as written, against this
    gateway."""
    code = python_example(doc, "from openai import OpenAI")
    code = code.replace("http://127.0.0.1:8000/v1", stack.base_url)
    for key in ('api_key="sk-local"', 'api_key="unused"'):
        code = code.replace(key, "api_key=KEY")
    exec(compile(code, doc, "exec"), {"KEY": API_KEY})
    assert "CompletionUsage(" in capsys.readouterr().out


def test_the_readme_client_example_runs(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's example of the bundled client, as written, against this stack's Redis."""
    code = python_example("README.md", "from clients import Client")
    code = code.replace("redis://localhost:6379/0", stack.redis.url)
    exec(compile(code, "README.md", "exec"), {})
    assert "Usage(" in capsys.readouterr().out
