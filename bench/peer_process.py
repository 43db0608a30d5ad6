"""A benchmark peer in its own process: start ``python -m <module> ... --out PATH``, follow the
JSON record it rewrites after each result, and stop it if the parent is interrupted.

The peer and the engine never share a process or GPU memory. A peer rewrites its record
whole (``write_json_atomically``) after every result, so a parent that is killed, or times
out, still holds every result that was finished: ``bench matrix`` saves each as it lands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEER_TIMEOUT_S = 3600
POLL_S = 0.5
STOP_GRACE_S = 10

OnRecord = Callable[[dict[str, Any]], None]


class PeerError(RuntimeError):
    """A peer could not run the workload (not installed, or the subprocess failed)."""


def write_json_atomically(path: Path, record: dict[str, Any]) -> None:
    """Replace ``path`` with ``record`` in one rename: a reader sees the old or the new file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1))
    os.replace(temporary, path)


def project_pythonpath(first: str | None = None) -> str:
    """The project's root first (after ``first``, if given), so the child imports the same
    workload code."""
    root = str(Path(__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(part for part in (first, root, rest) if part)


def run_peer_module(
    module: str,
    arguments: list[str],
    *,
    name: str,
    on_record: OnRecord | None = None,
    timeout_s: float = PEER_TIMEOUT_S,
    env: dict[str, str] | None = None,
    path_first: str | None = None,
) -> dict[str, Any]:
    """Run ``module`` with ``arguments`` and ``--out``; its final record. ``on_record`` gets
    the record each time the child adds a result to it (from this thread, between polls).
    ``env`` adds to the child's environment; ``path_first`` goes before the project root on
    its ``PYTHONPATH``."""
    with tempfile.TemporaryDirectory(prefix="pagestream-peer-") as tmp:
        out = Path(tmp) / "peer.json"
        command = [sys.executable, "-m", module, *arguments, "--out", str(out)]
        child_env = {**os.environ, **(env or {}), "PYTHONPATH": project_pythonpath(path_first)}
        print(f"{name} peer: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        process = subprocess.Popen(command, env=child_env)
        try:
            record = _follow(process, out, on_record, time.monotonic() + timeout_s)
        finally:
            _stop(process)
        if process.returncode != 0 or record is None:
            raise PeerError(
                f"the {name} peer failed (exit code {process.returncode}); see its output"
            )
        return record


def _follow(
    process: subprocess.Popen[bytes],
    out: Path,
    on_record: OnRecord | None,
    deadline: float,
) -> dict[str, Any] | None:
    """Poll until the child exits; report each record with more results than the last."""
    record, num_seen = None, 0
    while True:
        exited = process.poll() is not None
        if out.exists():
            record = json.loads(out.read_text())
            if on_record is not None and len(record["results"]) > num_seen:
                num_seen = len(record["results"])
                on_record(record)
        if exited:
            return record
        if time.monotonic() > deadline:
            raise PeerError("the peer ran past its time limit")
        time.sleep(POLL_S)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End the child if it still runs (the parent was interrupted): its GPU memory with it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
