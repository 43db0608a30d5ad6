"""The client library: wire types, URLs, no torch, and the ``submit``/``cancel`` verbs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from clients import AsyncClient, DoneEvent, FinishReason, TokenEvent, Usage, protocol
from commands import main
from tests.redis_server import RedisServer


def test_clients_never_import_torch() -> None:
    code = "import sys, clients, clients.protocol; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_request_and_events_round_trip_with_a_version() -> None:
    request = protocol.Request(id="r1", prompt="hi", max_tokens=3, stop=["x"], enqueued_at_ms=5)
    assert protocol.decode_request(protocol.encode(request)) == request
    assert msgspec.msgpack.decode(protocol.encode(request))["v"] == protocol.PROTOCOL_VERSION
    done = DoneEvent(
        finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=2, completion_tokens=1)
    )
    token = TokenEvent(seq=0, text="a", token_ids=[7])
    for event in (done, token):
        raw = msgspec.msgpack.decode(protocol.encode(event))
        assert raw["v"] == 1 and raw["event_id"] == ""
        assert protocol.decode_event(protocol.encode(event), "1-0") == msgspec.structs.replace(
            event, event_id="1-0"
        )


def test_request_errors_name_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match="colour"):
        protocol.decode_request(msgspec.msgpack.encode({"id": "r", "colour": 1}))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_tokens"):
        protocol.decode_request(msgspec.msgpack.encode({"id": "r", "max_tokens": "ten"}))
    assert protocol.peek_request_id(msgspec.msgpack.encode({"id": "r9", "bad": 1})) == "r9"
    assert protocol.peek_request_id(b"\xc1") is None


def map_with(*pairs: tuple[str, bytes]) -> bytes:
    """A msgpack map of str keys to raw (possibly invalid) msgpack values."""
    enc = msgspec.msgpack.encode
    return bytes([0x80 | len(pairs)]) + b"".join(enc(key) + value for key, value in pairs)


def test_an_id_is_read_next_to_what_msgspec_refuses() -> None:
    enc = msgspec.msgpack.encode
    deep = b"\x91" * 50_000 + enc("x")  # deeper than msgspec's recursion limit
    bad_utf8 = b"\xa4\xff\xfe\xfd\xfc"
    for before_id in ([], [("messages", deep)], [("prompt", bad_utf8)], [("b", b"\xc5\x00\x02ab")]):
        payload = map_with(("v", enc(1)), *before_id, ("id", enc("r7")), ("prompt", bad_utf8))
        assert protocol.peek_request_id(payload) == "r7"
    # and where no id can be read, none is made up
    for payload in (
        map_with(("id", bad_utf8)),  # the id itself is not UTF-8
        map_with(("id", enc(7))),  # not a string
        map_with(("prompt", deep[:1000])),  # cut off before the id
        map_with(("id", enc("x" * 300))),  # too long to be an id
        enc(["id", "r7"]),  # not a map
        b"\x81\xc1",  # a byte that starts no value
    ):
        assert protocol.peek_request_id(payload) is None, payload[:20]


def test_keys_share_the_prefix() -> None:
    keys = protocol.Keys("ps")
    assert (keys.requests, keys.group, keys.cancels, keys.dead) == (
        "ps:requests", "ps:workers", "ps:cancels", "ps:dead",
    )  # fmt: skip
    assert (keys.out("a"), keys.cancel("a"), keys.claim("a"), keys.worker("w")) == (
        "ps:out:{a}",
        "ps:cancel:{a}",
        "ps:claim:{a}",
        "ps:worker:w",
    )


def test_a_requests_keys_share_one_cluster_slot_and_requests_spread() -> None:
    from redis.crc import key_slot

    keys = protocol.Keys()
    for request_id in ("a", "chatcmpl-0123abcd", "x:y", "a}b"):
        slots = {key_slot(k.encode()) for k in (keys.out(request_id), keys.cancel(request_id),
                                                 keys.claim(request_id))}  # fmt: skip
        assert len(slots) == 1, request_id
    spread = {key_slot(keys.out(f"r{i}").encode()) for i in range(100)}
    assert len(spread) > 90  # ids land on many slots (16384 in all)


def test_tls_and_password_urls_are_understood() -> None:
    client = AsyncClient("rediss://:s3cret@redis.example:6380/2")
    kwargs = client.redis.connection_pool.connection_kwargs
    assert kwargs["password"] == "s3cret" and kwargs["port"] == 6380 and kwargs["db"] == 2
    assert "SSL" in client.redis.connection_pool.connection_class.__name__


def test_submit_prints_tokens_and_cancel_verb(
    start_worker: Any, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    start_worker("w1")
    url = ["--redis-url", redis_server.url]
    assert (
        main(["submit", "w5 w6 w7", *url, "--max-tokens", "5", "--ignore-eos", "--id", "cli"]) == 0
    )
    captured = capsys.readouterr()
    assert "finish_reason=length" in captured.err and "worker=w1" in captured.err
    r = redis_server.client()
    texts = [protocol.decode_event(f[b"msg"]) for _, f in r.xrange(protocol.Keys().out("cli"))]
    r.close()
    assert (
        captured.out.strip() == "".join(e.text for e in texts if isinstance(e, TokenEvent)).strip()
    )
    assert main(["cancel", "cli-2", *url]) == 0
    assert "cancel sent" in capsys.readouterr().err


@pytest.mark.parametrize("bad_id", ["", "x" * 257, "tab\there", "new\nline"])
def test_what_no_worker_could_read_is_refused_before_it_is_sent(
    redis_server: RedisServer, bad_id: str
) -> None:
    async def submit() -> None:
        async with AsyncClient(redis_server.url) as client:
            with pytest.raises(ValueError, match=r"request_id must be 1\.\.256 printable"):
                await client.submit("w5", request_id=bad_id)
            assert await client.submit("w5", request_id="x" * 256) == "x" * 256
            with pytest.raises(ValueError, match=r"^seed: integers must fit 64 bits"):
                await client.submit("w5", seed=2**64)
            with pytest.raises(ValueError, match=r"^token_ids: integers must fit 64 bits"):
                await client.submit(token_ids=[5, -(2**63) - 1])
            with pytest.raises(ValueError, match="not a request id"):
                await client.cancel(bad_id)

    asyncio.run(submit())
    r = redis_server.client()
    assert r.xlen(protocol.Keys().requests) == 1  # only the good one
    assert r.xlen(protocol.Keys().cancels) == 0  # and no cancel notice
    r.close()
    assert main(["cancel", bad_id, "--redis-url", redis_server.url]) == 2  # a usage error


@pytest.mark.parametrize(
    "script",
    [
        # the ``pagestream up`` banner's one-liner: the client is dropped after the call
        "from clients import Client; print(Client({url!r}).complete({args}).text)",
        # a client still referenced at interpreter exit
        "from clients import Client; client = Client({url!r}); print(client.complete({args}).text)",
    ],
    ids=["dropped", "at-exit"],
)
def test_a_sync_client_left_open_exits_cleanly(
    start_worker: Any, redis_server: RedisServer, script: str
) -> None:
    """No ``with``, no ``close()``: the process still exits without complaint.

    The reader task, still blocked in ``XREAD``, used to be destroyed by the garbage
    collector at interpreter exit after its loop had stopped ("Task was destroyed but it is
    pending!", ``RuntimeError: no running event loop``).
    """
    start_worker("w1")
    code = script.format(
        url=redis_server.url, args="prompt='w5 w6', max_tokens=5, ignore_eos=True, temperature=0"
    )
    for _ in range(5):  # the failure was a race, lost in most runs
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == 0, run.stderr
        assert len(run.stdout.split()) == 5
        for complaint in ("Task was destroyed", "RuntimeError", "Exception ignored"):
            assert complaint not in run.stderr, run.stderr


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PAGESTREAM_ROUTING", "on", True),
        ("PAGESTREAM_ROUTING", " YES ", True),
        ("PAGESTREAM_ROUTING", "0", False),
        ("PAGESTREAM_ROUTING", "", False),
        ("PAGESTREAM_ROUTING", "maybe", None),
        ("PAGESTREAM_REDIS_CLUSTER", "1", True),
        ("PAGESTREAM_REDIS_CLUSTER", "enabled", None),
    ],
)
def test_the_clients_switches_read_the_environment_as_the_worker_does(
    variable: str, value: str, expected: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """on/1/true/yes and off/0/false/no, empty as unset; another word names the variable (the
    client read "maybe" as off where the worker refused it)."""
    from clients.connect import cluster_from_env
    from clients.router import routing_from_env

    read = routing_from_env if variable == "PAGESTREAM_ROUTING" else cluster_from_env
    monkeypatch.setenv(variable, value)
    if expected is None:
        with pytest.raises(ValueError, match=f"{variable}='{value}': expected on or off"):
            read()
    else:
        assert read() is expected
