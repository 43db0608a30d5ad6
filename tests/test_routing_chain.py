"""Prefix-aware routing, step 1 (docs/routing.md): the client-side chain and the choice."""

from __future__ import annotations

import itertools
import random

import pytest

from clients.routing import (
    MAX_CHARS_PER_LINK,
    MAX_TOKENS_PER_LINK,
    MIN_CHARS_PER_LINK,
    MIN_TOKENS_PER_LINK,
    WorkerLoad,
    balance_gap,
    choose_worker,
    choose_worker_why,
    link_key,
    out_of_balance,
    prefix_chain,
)

SYSTEM = {"role": "system", "content": "You are terse."}


def test_a_conversations_next_turn_extends_its_chain() -> None:
    turn1 = [SYSTEM, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    chain1, chain2 = prefix_chain(messages=turn1), prefix_chain(messages=turn2)
    assert len(chain1) == 2 and len(chain2) == 4 and chain2[:2] == chain1
    other = prefix_chain(messages=[SYSTEM, {"role": "user", "content": "Hey"}])
    assert other[0] == chain1[0] and other[1] != chain1[1]  # the system prompt is shared
    # the role is part of a link, and a boundary cannot be moved between role and content
    assert prefix_chain(messages=[{"role": "user", "content": "x"}]) != prefix_chain(
        messages=[{"role": "system", "content": "x"}]
    )


def test_prompts_and_token_ids_are_cut_by_content_so_a_next_turn_keeps_every_link() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(50_000) for _ in range(400)]
    chain = prefix_chain(token_ids=ids)
    assert 400 // MAX_TOKENS_PER_LINK <= len(chain) <= 400 // MIN_TOKENS_PER_LINK
    for end in (37, 150, 399):  # any earlier turn, cut anywhere: its whole chain is a prefix
        earlier = prefix_chain(token_ids=ids[:end])
        assert chain[: len(earlier)] == earlier
        assert len(earlier) >= (end - 2 * MAX_TOKENS_PER_LINK) // MAX_TOKENS_PER_LINK
    assert prefix_chain(token_ids=ids[1:])[:3] != chain[:3]  # shifted: a different history
    text = " ".join(f"word{rng.randrange(1000)}" for _ in range(300))
    links = prefix_chain(prompt=text)
    assert len(text) // MAX_CHARS_PER_LINK <= len(links) <= len(text) // MIN_CHARS_PER_LINK
    assert links[: len(prefix_chain(prompt=text[:900]))] == prefix_chain(prompt=text[:900])
    assert prefix_chain(prompt="short") == [] and prefix_chain(token_ids=[1, 2]) == []
    with pytest.raises(ValueError):
        prefix_chain()


def test_the_deepest_live_holder_wins_and_a_busy_one_yields() -> None:
    idle = WorkerLoad(num_in_flight=1, max_in_flight=8, num_waiting=0)
    idler = WorkerLoad(num_in_flight=0, max_in_flight=8, num_waiting=0)
    full = WorkerLoad(num_in_flight=8, max_in_flight=8, num_waiting=0)
    queued = WorkerLoad(num_in_flight=3, max_in_flight=8, num_waiting=2)
    holders = [["a"], ["b"], []]
    assert choose_worker(holders, {"a": idle, "b": idle}) == "b"
    assert choose_worker(holders, {"a": idle}) == "a"  # b is gone: a holds the first link
    assert choose_worker(holders, {"a": idle, "b": full}) is None  # the shared stream
    assert choose_worker(holders, {"a": idle, "b": queued}) is None
    assert choose_worker([[], []], {"a": idle}) is None
    # several hold the deepest link (a shared system prompt): the shared stream balances it
    assert choose_worker([["a", "b"]], {"a": idle, "b": idler}) is None
    assert choose_worker([["a", "b"]], {"a": idle}) == "a"  # b is gone
    assert link_key("ps", bytes([1, 255])) == "ps:px:01ff"


def test_a_holder_far_busier_than_the_least_loaded_worker_yields() -> None:
    """SGLang's balance rule: at least the balance gap (a sixteenth of the holder's capacity,
    4 at least) more requests than the least loaded live worker, and more than BALANCE_RATIO
    times as many, sends the entry to the shared stream."""

    def load(n: int) -> WorkerLoad:
        return WorkerLoad(num_in_flight=n, max_in_flight=64, num_waiting=0)  # gap 4

    big = [WorkerLoad(num_in_flight=n, max_in_flight=256, num_waiting=0) for n in (4, 19, 20)]
    assert [balance_gap(worker.max_in_flight) for worker in (load(1), big[0])] == [4, 16]
    assert choose_worker([["a"], []], {"a": big[1], "b": big[0]}) == "a"  # 15 more: not 16
    assert choose_worker([["a"], []], {"a": big[2], "b": big[0]}) is None  # 16 more, 5x
    small = WorkerLoad(num_in_flight=5, max_in_flight=8, num_waiting=0)
    assert balance_gap(small.max_in_flight) == 4 and out_of_balance(small, [small, load(0)])

    holders = [["a"], []]
    assert choose_worker(holders, {"a": load(12), "b": load(4)}) is None  # 8 more, 3x
    assert choose_worker(holders, {"a": load(8), "b": load(4)}) == "a"  # 2x: not more than
    assert choose_worker(holders, {"a": load(5), "b": load(0)}) is None
    assert choose_worker(holders, {"a": load(3), "b": load(0)}) == "a"  # fewer than 4 more
    assert choose_worker(holders, {"a": load(12)}) == "a"  # alone: nothing to balance
    waiting = WorkerLoad(num_in_flight=4, max_in_flight=64, num_waiting=8)
    assert choose_worker(holders, {"a": waiting, "b": load(4)}) is None  # waiting counts
    assert out_of_balance(load(9), [load(9), load(4)]) and not out_of_balance(load(4), [load(4)])
    assert choose_worker_why(holders, {"a": load(12), "b": load(4)}) == (None, "out of balance")
    assert choose_worker_why(holders, {"a": load(8), "b": load(4)}) == ("a", "holder")
    assert choose_worker_why([["a", "b"]], {"a": load(1), "b": load(1)}) == (None, "several hold")
    assert choose_worker_why([[]], {"a": load(1)}) == (None, "no holder")


def test_a_pinned_session_wins_while_it_is_live_and_not_busy() -> None:
    idle = WorkerLoad(num_in_flight=1, max_in_flight=8, num_waiting=0)
    full = WorkerLoad(num_in_flight=8, max_in_flight=8, num_waiting=0)
    holders = [["a"], ["b"]]
    assert choose_worker(holders, {"a": idle, "b": idle, "c": idle}, pinned="c") == "c"
    assert choose_worker(holders, {"a": idle, "b": idle, "c": full}, pinned="c") == "b"
    assert choose_worker(holders, {"a": idle, "b": idle}, pinned="c") == "b"  # c is gone


def test_a_client_reads_a_chains_last_links_each_and_probes_the_rest() -> None:
    from clients.routing import DENSE_TAIL_LINKS, probed_links

    assert probed_links(0) == [] and probed_links(3) == [0, 1, 2]
    assert probed_links(DENSE_TAIL_LINKS) == list(range(DENSE_TAIL_LINKS))
    assert probed_links(DENSE_TAIL_LINKS + 11)[:5] == [0, 3, 7, 9, 10]
    for num_links in range(1, 400):
        probes = probed_links(num_links)
        assert probes == sorted(set(probes)) and probes[0] == 0 and probes[-1] == num_links - 1
        dense = max(num_links - DENSE_TAIL_LINKS, 0)
        assert probes[len(probes) - (num_links - dense) :] == list(range(dense, num_links))
        assert len(probes) <= DENSE_TAIL_LINKS + dense.bit_length() + 1
        # each gap before the dense part at most twice the one after it
        gaps = [b - a for a, b in itertools.pairwise(probes)]
        assert all(gap <= 2 * later for gap, later in itertools.pairwise(gaps))


def test_token_cuts_walk_only_the_marked_ids_and_give_the_general_rules_spans() -> None:
    """``_token_cuts`` (the fast walk) against ``_cuts`` with the per-token rule: the same
    spans, so links stay those that earlier clients and workers compute."""
    from clients.routing import TOKENS_PER_LINK, _cuts, _token_cuts

    rng = random.Random(5)
    for _ in range(400):
        vocab = rng.choice([3, 40, 150_000])  # few ids: long runs with and without marks
        token_ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 900))]

        def cut_after(i: int, token_ids: list[int] = token_ids) -> bool:
            mixed = (token_ids[i] * 0x9E3779B1) & 0xFFFFFFFF
            return (mixed >> 16) % TOKENS_PER_LINK == 0

        expected = _cuts(len(token_ids), cut_after, MIN_TOKENS_PER_LINK, MAX_TOKENS_PER_LINK)
        assert _token_cuts(token_ids) == expected
