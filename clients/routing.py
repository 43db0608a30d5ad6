"""Prefix-aware routing, step 1 of docs/routing.md: the chain a client can compute, and the
choice of worker from what the workers published. Pure (no Redis, no tokenizer), so that the
client, the gateway and the workers compute the same links.

The Redis side is ``clients/router.py`` (the client's choice) and ``worker/routing.py``.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from clients.protocol import Request

LINK_BYTES = 16  # a link's hash, truncated: 2^-64 collisions per pair are far below a miss's cost
# Prompts and token ids are cut where their content says (content-defined chunking), not every
# N: a cut depends only on what is before it (a window of the last few items), so turn k+1,
# which starts with turn k's prompt, has every one of turn k's cuts; fixed chunks would put a
# session's own text in a chunk the next turn does not share whenever it is shorter than one.
TOKENS_PER_LINK = 32  # a cut after a token whose mixed id is 0 mod 32: links of 32 on average
MIN_TOKENS_PER_LINK, MAX_TOKENS_PER_LINK = 8, 128
TEXT_CHARS_PER_LINK = 128  # a cut where the crc of the last 8 characters is 0 mod 128
MIN_CHARS_PER_LINK, MAX_CHARS_PER_LINK = 32, 512
_TEXT_WINDOW = 8
_ROOT = b"pagestream-prefix-v1"


def prefix_chain(
    *,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
) -> list[bytes]:
    """The request's chain of links, each hashing everything before it: one per message, or
    one per content-defined chunk of a prompt or of token ids (a trailing chunk without a cut
    after it is left out: the next turn may not share it). A request whose chain is a prefix
    of another's shares that much of its history."""
    if messages is not None:
        parts = [f"{m['role']}\x00{m['content']}".encode() for m in messages]
    elif prompt is not None:
        parts = [prompt[a:b].encode() for a, b in _text_cuts(prompt)]
    elif token_ids is not None:
        parts = [",".join(map(str, token_ids[a:b])).encode() for a, b in _token_cuts(token_ids)]
    else:
        raise ValueError("give one of prompt, messages, token_ids")
    chain, parent = [], _ROOT
    for part in parts:
        digest = hashlib.sha256(parent + len(part).to_bytes(8, "little") + part).digest()
        parent = digest[:LINK_BYTES]
        chain.append(parent)
    return chain


def _token_cuts(token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``_cuts`` of token ids (the same spans), walking only the ids that may end a chunk: a
    client routes every request, and a loop over every token of a 6,000-token prompt took
    most of its route's time."""
    marks = [  # Fibonacci hashing spreads the ids
        i
        for i, token in enumerate(token_ids)
        if (((token * 0x9E3779B1) & 0xFFFFFFFF) >> 16) % TOKENS_PER_LINK == 0
    ]
    spans, start = [], 0
    for mark in marks:
        while mark + 1 - start > MAX_TOKENS_PER_LINK:  # a chunk too long ends at the maximum
            spans.append((start, start + MAX_TOKENS_PER_LINK))
            start += MAX_TOKENS_PER_LINK
        if mark + 1 - start >= MIN_TOKENS_PER_LINK:
            spans.append((start, mark + 1))
            start = mark + 1
    while len(token_ids) - start >= MAX_TOKENS_PER_LINK:
        spans.append((start, start + MAX_TOKENS_PER_LINK))
        start += MAX_TOKENS_PER_LINK
    return spans


def _text_cuts(text: str) -> list[tuple[int, int]]:
    def cut_after(i: int) -> bool:
        window = text[max(0, i + 1 - _TEXT_WINDOW) : i + 1].encode()
        return zlib.crc32(window) % TEXT_CHARS_PER_LINK == 0

    return _cuts(len(text), cut_after, MIN_CHARS_PER_LINK, MAX_CHARS_PER_LINK)


def _cuts(
    length: int, cut_after: Callable[[int], bool], min_len: int, max_len: int
) -> list[tuple[int, int]]:
    """[start, end) of each chunk that ends in a cut: after ``min_len`` items, where
    ``cut_after`` says, or at ``max_len`` (from the chunk's start, itself a cut)."""
    spans, start = [], 0
    for i in range(length):
        size = i + 1 - start
        if size >= max_len or (size >= min_len and cut_after(i)):
            spans.append((start, i + 1))
            start = i + 1
    return spans


DENSE_TAIL_LINKS = 32  # the last links a client reads every one of (about 1,000 tokens)


def probed_links(num_links: int) -> list[int]:
    """The indexes of the links of a chain of ``num_links`` that a client reads, in chain
    order: each of the last ``DENSE_TAIL_LINKS``, then back by 1, 2, 4, ... links from there,
    and the first. A worker publishes a request's whole chain, so the workers holding a link
    hold every link before it; what a turn adds (the last reply and the new message, rarely
    more than ``DENSE_TAIL_LINKS``) is read link by link, so the deepest held link is found
    exactly there, and a longer history only costs a probe's precision where nobody holds
    the dense part. A 6,000-token prompt (164 links) reads 41 keys instead of 164. (Probing
    from the last link alone, by powers of two, missed holders of short chains: on the CPU
    bench 26 of 96 turns went to the shared stream against 18.)"""
    first_dense = max(num_links - DENSE_TAIL_LINKS, 0)
    indexes, index, step = [], first_dense - 1, 1
    while index > 0:
        indexes.append(index)
        index, step = index - step, step * 2
    if first_dense:
        indexes.append(0)
    return indexes[::-1] + list(range(first_dense, num_links))


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
    def load(self) -> int:
        """Requests it holds: running and waiting in its engine."""
        return self.num_in_flight + self.num_waiting

    @property
    def is_busy(self) -> bool:
        """Affinity yields: it has no free slot (past its admission capacity), or a backlog
        waits in its engine (for memory). One or two waiting are normal between a read and the
        next step, and a heartbeat is seconds old: only a backlog counts."""
        backlog = max(2, self.max_in_flight // 4)
        return self.num_in_flight >= self.max_in_flight or self.num_waiting >= backlog


# Affinity yields to a fleet out of balance, as SGLang's cache-aware router switches to the
# shortest queue: a holder with at least its balance gap more requests than the least loaded
# live worker, and more than BALANCE_RATIO times as many. The gap is a share of the holder's
# capacity, BALANCE_GAP at least: a GPU worker's step takes about as long at 8 sequences as
# at 2, so a handful more costs its turns little, while each yield costs a prefill. With a
# gap of 4 on four H200s (max_in_flight 256, 4 turns in flight each), 41-144 of 384 turns
# yielded on heartbeat loads seconds old, and the hit rate fell to 0.65 and 0.51 of one
# worker's 0.69; with 16, none yielded, the hit rate was 0.69 and the split 100/96/96/92.
BALANCE_GAP = 4
BALANCE_CAPACITY_SHARE = 16  # gap = max(BALANCE_GAP, max_in_flight // this)
BALANCE_RATIO = 2.0


def choose_worker(
    holders: Sequence[Sequence[str]], live: Mapping[str, WorkerLoad], pinned: str | None = None
) -> str | None:
    """The worker to route to, from each link's holders (in chain order) and the heartbeats
    of the live routing workers (``live``: holders or not): the live holder of the deepest
    link that any live worker holds, since it served a request holding every link up to
    there. A session's ``pinned`` worker comes first while it is live and not busy. None (the
    shared stream) when no live worker holds any link; when that holder is busy or far busier
    than the least loaded live worker (affinity yields to load: ``out_of_balance``); or when
    several live workers hold that link (a system prompt every worker has seen: any of them
    serves it, and the shared stream, where idle workers pull, balances the load better than
    heartbeats seconds old would). ``choose_worker_why`` says which."""
    return choose_worker_why(holders, live, pinned)[0]


def choose_worker_why(
    holders: Sequence[Sequence[str]], live: Mapping[str, WorkerLoad], pinned: str | None = None
) -> tuple[str | None, str]:
    """``choose_worker``'s answer and its reason: ``pinned``, ``holder``, or for the shared
    stream ``no holder``, ``several hold``, ``busy``, ``out of balance``."""
    if pinned is not None and pinned in live and not live[pinned].is_busy:
        return pinned, "pinned"
    for names in reversed(holders):
        alive = [name for name in names if name in live]
        if len(alive) == 1:
            holder = alive[0]
            if live[holder].is_busy:
                return None, "busy"
            if out_of_balance(live[holder], live.values()):
                return None, "out of balance"
            return holder, "holder"
        if alive:
            return None, "several hold"
    return None, "no holder"


def out_of_balance(holder: WorkerLoad, fleet: Iterable[WorkerLoad]) -> bool:
    """Whether ``holder`` carries so much more than the least loaded of ``fleet`` that its
    cache is not worth the wait: its conversations, once they start on it, stay, and without
    this a worker that pulled more new conversations early kept them (two workers on one H100
    finished 145 and 47 requests). Yielding sends the entry to the shared stream, where the
    idle worker pulls it (a heartbeat is seconds old: no worker is picked from it)."""
    least = min((worker.load for worker in fleet), default=holder.load)
    gap = balance_gap(holder.max_in_flight)
    return holder.load - least >= gap and holder.load > BALANCE_RATIO * least


def balance_gap(max_in_flight: int) -> int:
    """How many more requests than the least loaded worker a worker that admits
    ``max_in_flight`` may carry before its affinity yields: a share of its capacity,
    ``BALANCE_GAP`` at least."""
    return max(BALANCE_GAP, max_in_flight // BALANCE_CAPACITY_SHARE)


def request_chain(request: Request) -> list[bytes]:
    """The chain of a protocol ``Request`` (what the client routes on and the worker publishes)."""
    if request.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return prefix_chain(messages=messages)
    if request.prompt is not None:
        return prefix_chain(prompt=request.prompt)
    return prefix_chain(token_ids=request.token_ids or [])
