"""``pagestream up --demo``: a few requests through the bundled client, streamed to the terminal.

First three questions one at a time, each answer printed as its tokens arrive; then a burst
of requests at once, to show continuous batching: the burst's combined rate is several times
one request's.
"""

from __future__ import annotations

import sys
import time

from clients import Client, ClientError, DoneEvent, RestartEvent, TokenEvent

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Name three rivers in Europe.",
)
BURST_TOPICS = ("the sea", "mountains", "bread", "trains", "owls", "rain", "clocks", "maps")
MAX_TOKENS = 64
REQUEST_TIMEOUT_S = 300.0  # a CPU worker with a cold cache is slow, not dead


def run_demo(redis_url: str, prefix: str, *, cluster: bool = False, shards: int = 1) -> None:
    """Send the demo's requests to the workers behind ``redis_url`` (a node of a Redis Cluster
    when ``cluster``, with ``shards`` request streams); print what comes back."""
    with Client(redis_url, prefix=prefix, timeout_s=REQUEST_TIMEOUT_S, cluster=cluster,
                shards=shards) as client:  # fmt: skip
        try:
            print("\n-- demo: three questions, one at a time, tokens as they arrive", flush=True)
            for question in QUESTIONS:
                _stream_one(client, question)
            print(f"\n-- demo: {len(BURST_TOPICS)} requests at once (continuous batching)")
            _burst(client)
        except ClientError as exc:  # e.g. a dummy: model, which has no tokenizer
            print(f"\nthe demo stopped: {exc}", file=sys.stderr, flush=True)


def _stream_one(client: Client, question: str) -> None:
    print(f"\n> {question}\n", flush=True)
    start_s = time.perf_counter()
    first_token_s: float | None = None
    messages = [{"role": "user", "content": question}]
    for event in client.stream(messages=messages, max_tokens=MAX_TOKENS, temperature=0):
        if isinstance(event, TokenEvent):
            first_token_s = first_token_s or time.perf_counter() - start_s
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, RestartEvent):
            sys.stdout.write(f"\n[worker died; restarting on {event.worker}]\n")
        elif isinstance(event, DoneEvent):
            elapsed_s = time.perf_counter() - start_s
            tokens = event.usage.completion_tokens
            print(f"\n[{tokens} tokens in {elapsed_s:.2f} s, first after {first_token_s or 0:.2f} s, "
                  f"{tokens / elapsed_s:.1f} tok/s, {event.finish_reason.value}]", flush=True)  # fmt: skip


def _burst(client: Client) -> None:
    start_s = time.perf_counter()
    ids = []
    for i, topic in enumerate(BURST_TOPICS):
        messages = [{"role": "user", "content": f"Tell me one short fact about {topic}."}]
        ids.append(client.submit(messages=messages, max_tokens=MAX_TOKENS, temperature=0.7, seed=i))
    completions = [client.result(request_id) for request_id in ids]
    elapsed_s = time.perf_counter() - start_s
    for topic, completion in zip(BURST_TOPICS, completions, strict=True):
        first_line = completion.text.strip().splitlines()[0] if completion.text.strip() else ""
        print(f"  {topic:>9}: {first_line[:100]}")
    tokens = sum(c.usage.completion_tokens for c in completions if c.usage is not None)
    print(f"[{len(ids)} requests, {tokens} tokens in {elapsed_s:.2f} s: "
          f"{tokens / elapsed_s:.1f} tok/s together]", flush=True)  # fmt: skip
