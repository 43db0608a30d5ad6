"""Prefix-aware routing, step 1 of docs/routing.md: the chain a client can compute, and the
choice of worker from what the workers published. Pure (no Redis, no tokenizer), so that the
client, the gateway and the workers compute the same links.

The Redis side is ``clients/router.py`` (the client's choice) and ``worker/routing.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clients.protocol import Request

LINK_BYTES = 16  # a link's hash, truncated: 2^-64 collisions per pair are far below a miss's cost
TEXT_CHARS_PER_LINK = 256  # about 64 tokens of English: a few links per turn
TOKENS_PER_LINK = 64  # about four 16-token pages
_ROOT = b"pagestream-prefix-v1"


def prefix_chain(
    *,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
) -> list[bytes]:
    """The request's chain of links, each hashing everything before it: one per message, per
    ``TEXT_CHARS_PER_LINK`` characters of a prompt, or per ``TOKENS_PER_LINK`` token ids (a
    trailing partial chunk of a prompt is left out: the next turn's prompt may not share it).
    A request whose chain is a prefix of another's shares that much of its history."""
    if messages is not None:
        parts = [f"{m['role']}\x00{m['content']}".encode() for m in messages]
    elif prompt is not None:
        parts = [
            prompt[i : i + TEXT_CHARS_PER_LINK].encode()
            for i in range(0, len(prompt) - TEXT_CHARS_PER_LINK + 1, TEXT_CHARS_PER_LINK)
        ]
    elif token_ids is not None:
        parts = [
            b",".join(str(t).encode() for t in token_ids[i : i + TOKENS_PER_LINK])
            for i in range(0, len(token_ids) - TOKENS_PER_LINK + 1, TOKENS_PER_LINK)
        ]
    else:
        raise ValueError("give one of prompt, messages, token_ids")
    chain, parent = [], _ROOT
    for part in parts:
        digest = hashlib.sha256(parent + len(part).to_bytes(8, "little") + part).digest()
        parent = digest[:LINK_BYTES]
        chain.append(parent)
    return chain


def link_key(prefix: str, link: bytes) -> str:
    """``{p}:px:{hex}``: a sorted set of the workers that served a request holding this link
    (score: when, in Unix ms), with a TTL refreshed on each write."""
    return f"{prefix}:px:{link.hex()}"


@dataclass(frozen=True)
class WorkerLoad:
    """What routing reads of a worker's heartbeat (``WorkerStatus``)."""

    num_in_flight: int
    max_in_flight: int
    num_waiting: int  # requests waiting inside its engine

    @property
    def is_busy(self) -> bool:
        """Affinity yields: it has no free slot (past its admission capacity), or a backlog
        waits in its engine (for memory). One or two waiting are normal between a read and the
        next step, and a heartbeat is seconds old: only a backlog counts."""
        backlog = max(2, self.max_in_flight // 4)
        return self.num_in_flight >= self.max_in_flight or self.num_waiting >= backlog


def choose_worker(
    holders: Sequence[Sequence[str]], live: Mapping[str, WorkerLoad], pinned: str | None = None
) -> str | None:
    """The worker to route to, from each link's holders (in chain order): a live holder of the
    deepest link that any live worker holds, since it served a request holding every link up
    to there; of several (a system prompt every worker has seen), the least loaded. A session's
    ``pinned`` worker comes first while it is live and not busy. None (the shared stream) when
    no live worker holds any link, or when every live holder of the deepest link is busy:
    affinity yields to load."""
    if pinned is not None and pinned in live and not live[pinned].is_busy:
        return pinned
    for names in reversed(holders):
        alive = [name for name in names if name in live]
        if alive:
            idle = [name for name in alive if not live[name].is_busy]
            if not idle:
                return None
            return min(idle, key=lambda name: (live[name].num_in_flight, name))
    return None


def request_chain(request: Request) -> list[bytes]:
    """The chain of a protocol ``Request`` (what the client routes on and the worker publishes)."""
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return prefix_chain(messages=messages)
    if request.prompt is not None:
        return prefix_chain(prompt=request.prompt)
    return prefix_chain(token_ids=request.token_ids or [])
