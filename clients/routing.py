"""Prefix-aware routing, step 1 of docs/routing.md: the chain a client can compute, and the
choice of worker from what the workers published. Pure (no Redis, no tokenizer), so that the
client, the gateway and the workers compute the same links.

Not wired into ``submit`` or the workers yet (steps 2-4 of the design).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LINK_BYTES = 16  # a link's hash, truncated: 2^-64 collisions per pair are far below a miss's cost
TEXT_CHARS_PER_LINK = 1024
TOKENS_PER_LINK = 256
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
    """``{p}:px:{hex}``: the worker that last served a request holding this link."""
    return f"{prefix}:px:{link.hex()}"


@dataclass(frozen=True)
class WorkerLoad:
    """What routing reads of a worker's heartbeat (``WorkerStatus``)."""

    num_in_flight: int
    max_in_flight: int
    num_waiting: int  # requests waiting inside its engine

    @property
    def is_busy(self) -> bool:
        """Affinity yields: requests already wait in its engine, or it has no free slot."""
        return self.num_waiting > 0 or self.num_in_flight >= self.max_in_flight


def choose_worker(owners: Sequence[str | None], live: Mapping[str, WorkerLoad]) -> str | None:
    """The worker to route to, from each link's owner (``MGET`` of the chain's keys, in chain
    order): the owner of the deepest link owned by a live worker, since it served a request
    holding every link up to there. None (the shared stream) when no live worker holds any
    link, or when that worker is busy."""
    for owner in reversed(owners):
        if owner is not None and owner in live:
            return None if live[owner].is_busy else owner
    return None
