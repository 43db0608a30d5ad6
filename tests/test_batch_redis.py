"""Batch jobs reach Redis the way the streams do, and a batch runner that fails says so.

arq's connection comes from the worker's Redis URL as redis-py reads it (``arq_settings``):
TLS options, ``%``-escaped credentials, database, unix sockets. A runner that loses Redis
backs off; one that Redis refuses (an ACL without a command arq needs) logs the error with
its traceback at once, leaves the stream service serving, and recovers once the ACL is fixed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError

import worker.batch_runner
from clients import BatchState, Client, FinishReason
from clients.batch import arq_settings
from tests.redis_server import RedisServer
from tests.test_batch_jobs import WAIT_S, BatchWorker
from tests.test_redis_security import create_users
from tests.test_redis_security import tls_url as tls_url  # a fixture, for this module too
from worker.batch import BatchSettings
from worker.batch_runner import BatchRunner
from worker.logs import configure_logging

LOG_WAIT_S = 10.0
LogLines = Callable[[], list[dict[str, Any]]]


@pytest.fixture
def logs(capsys: pytest.CaptureFixture[str]) -> Iterator[LogLines]:
    """The JSON log lines (``configure_logging``) written so far; logging is restored after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging(json_logs=True)
    lines: list[dict[str, Any]] = []

    def read() -> list[dict[str, Any]]:
        err = capsys.readouterr().err
        lines.extend(json.loads(line) for line in err.splitlines() if line.startswith("{"))
        return lines

    yield read
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
    structlog.reset_defaults()


def batch_log(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("logger") == "worker.batch_runner"]


# -- the URL -------------------------------------------------------------------------------------


def test_arq_settings_take_tls_options_and_escaped_credentials() -> None:
    url = (
        "rediss://w%40rker:p%40ss%3Aw%2Frd%25@redis.internal:6380/3?ssl_ca_certs=/etc/ca.crt"
        "&ssl_certfile=/etc/client.crt&ssl_keyfile=/etc/client.key&ssl_cert_reqs=optional"
        "&ssl_check_hostname=true"
    )
    settings = arq_settings(url)
    assert (settings.host, settings.port, settings.database) == ("redis.internal", 6380, 3)
    assert (settings.username, settings.password) == ("w@rker", "p@ss:w/rd%")
    assert settings.ssl and settings.ssl_check_hostname is True
    assert (settings.ssl_ca_certs, settings.ssl_certfile, settings.ssl_keyfile) == (
        "/etc/ca.crt", "/etc/client.crt", "/etc/client.key",
    )  # fmt: skip
    assert settings.ssl_cert_reqs == "optional"
    # The same values the stream service's redis-py connections get from the URL.
    service = aioredis.Redis.from_url(url).connection_pool.connection_kwargs
    for name in ("username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
                 "ssl_cert_reqs", "ssl_check_hostname"):  # fmt: skip
        assert getattr(settings, name) == service[name], name


def test_arq_settings_of_plain_unix_and_tuned_urls() -> None:
    plain = arq_settings("redis://:pw@127.0.0.1:6379/0")
    assert (plain.host, plain.port, plain.database, plain.username, plain.password) == (
        "127.0.0.1", 6379, 0, None, "pw",
    )  # fmt: skip
    assert not plain.ssl and plain.unix_socket_path is None
    assert (plain.conn_timeout, plain.conn_retries) == (1, 5)  # arq's defaults stay
    unix = arq_settings("unix://u:p%25@/run/redis.sock?db=2")
    assert (unix.unix_socket_path, unix.database, unix.username, unix.password) == (
        "/run/redis.sock", 2, "u", "p%",
    )  # fmt: skip
    tuned = arq_settings("redis://h?db=4&socket_connect_timeout=2.5&max_connections=8")
    assert (tuned.database, tuned.conn_timeout, tuned.max_connections) == (4, 2.5, 8)


def test_a_url_option_arq_cannot_apply_is_refused_when_batch_jobs_are_on() -> None:
    url = "redis://localhost/0?socket_timeout=5"
    with pytest.raises(ValueError, match=r"socket_timeout .*--batch-jobs 0"):
        BatchSettings(redis_url=url, worker_name="w")
    assert BatchSettings(redis_url=url, worker_name="w", max_jobs=0).max_jobs == 0
    with pytest.raises(ValueError, match="scheme"):
        arq_settings("http://localhost:6379")


def test_a_batch_job_runs_over_tls_with_a_private_ca_and_an_escaped_password(
    tls_url: str, text_model_dir: Path
) -> None:
    user, password = "b@tch", "p@ss:w/rd%#?"
    admin = redis.Redis.from_url(tls_url)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"],
                      commands=["+@all"])  # fmt: skip
    admin.close()
    url = tls_url.replace(
        "rediss://", f"rediss://{quote(user, safe='')}:{quote(password, safe='')}@"
    )
    batch_worker = BatchWorker(text_model_dir, url)
    try:
        with Client(url) as client:
            job_id = client.submit_batch(["w5 w6", "w7"], max_tokens=3, ignore_eos=True)
            result = client.batch_result(job_id, timeout_s=WAIT_S)
    finally:
        batch_worker.stop()
    assert result.status.state is BatchState.COMPLETE
    assert [len(r["token_ids"]) for r in result.records] == [3, 3]


# -- a failing runner ----------------------------------------------------------------------------


def test_lost_connections_back_off_and_other_failures_are_logged_with_a_traceback(
    monkeypatch: pytest.MonkeyPatch, logs: LogLines
) -> None:
    # a run shorter than the cap keeps the backoff: the cap is wide enough (0.2 s) that a
    # loaded machine's scheduling does not stretch a "0.0 s" run past it
    monkeypatch.setattr(worker.batch_runner, "RESTART_BACKOFF_S", 0.05)
    monkeypatch.setattr(worker.batch_runner, "MAX_RESTART_BACKOFF_S", 0.2)
    settings = BatchSettings(redis_url="redis://localhost/0", worker_name="w", failure_retry_s=0.1)
    runner = BatchRunner(settings, None)  # type: ignore[arg-type]
    lost = RedisConnectionError("Connection refused")
    # (how long arq runs, how it stops); after the last one the runner is asked to stop.
    runs: list[tuple[float, Exception]] = [
        (0.0, lost), (0.0, lost), (0.0, lost), (0.0, lost),  # 0.05, 0.1, 0.2, 0.2
        (0.0, NoPermissionError("no permissions to run the 'zrangebyscore' command")),
        (0.0, lost),  # 0.2: a refusal does not reset the backoff
        (0.3, lost),  # ran longer than the backoff's cap: a new outage, 0.05 again
    ]  # fmt: skip

    async def run_once() -> None:
        if not runs:
            runner.request_stop()
            return
        run_s, failure = runs.pop(0)
        await asyncio.sleep(run_s)
        raise failure

    monkeypatch.setattr(runner, "_run_once", run_once)
    asyncio.run(asyncio.wait_for(runner.run(), WAIT_S))  # never raises
    lines = batch_log(logs())
    assert [(line["level"], line["retry_in_s"]) for line in lines] == [
        ("warning", 0.05), ("warning", 0.1), ("warning", 0.2), ("warning", 0.2),
        ("error", 0.1), ("warning", 0.2), ("warning", 0.05),
    ]  # fmt: skip
    refused = lines[4]
    assert "zrangebyscore" in refused["error"]
    assert "Traceback" in refused["exception"] and "NoPermissionError" in refused["exception"]
    assert "exception" not in lines[0]  # a lost connection is no bug: one line, no traceback


def test_a_refused_runner_logs_at_once_streams_go_on_and_a_fixed_acl_recovers_it(
    redis_server: RedisServer, text_model_dir: Path, logs: LogLines
) -> None:
    admin = redis_server.client()
    urls = create_users(admin, redis_server.port)
    admin.execute_command("ACL", "SETUSER", "worker", "-zrangebyscore")  # arq polls with it
    batch_worker = BatchWorker(text_model_dir, urls["worker"], failure_retry_s=0.5)
    try:
        deadline_s = time.monotonic() + LOG_WAIT_S
        while not (errors := [e for e in batch_log(logs()) if e["level"] == "error"]):
            assert time.monotonic() < deadline_s, "the refused runner logged no error"
            time.sleep(0.05)
        assert "zrangebyscore" in errors[0]["error"]
        assert "NoPermissionError" in errors[0]["exception"]
        with Client(urls["client"]) as client:
            completion = client.complete("w5 w6", max_tokens=4, ignore_eos=True, timeout_s=60)
            assert completion.finish_reason is FinishReason.LENGTH
            job_id = client.submit_batch(["w5 w6"], max_tokens=2, ignore_eos=True)
            time.sleep(1.0)  # two retries of the runner
            assert client.batch_status(job_id).state is BatchState.QUEUED
            admin.execute_command("ACL", "SETUSER", "worker", "+zrangebyscore")  # the fix
            result = client.batch_result(job_id, timeout_s=WAIT_S)
        assert result.status.state is BatchState.COMPLETE
        assert len(result.records[0]["token_ids"]) == 2
    finally:
        batch_worker.stop()
        admin.close()
