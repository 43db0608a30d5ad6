"""Batch jobs reach Redis the way the streams do: arq's connection comes from the worker's
Redis URL as redis-py reads it (``arq_settings``): TLS options, ``%``-escaped credentials,
database, unix sockets.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import redis.asyncio as aioredis

from clients import BatchState, Client
from clients.batch import arq_settings
from tests.test_batch_jobs import WAIT_S, BatchWorker
from tests.test_redis_security import tls_url as tls_url  # a fixture, for this module too
from worker.batch import BatchSettings

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
