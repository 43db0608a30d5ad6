"""bench/vllm_site/sitecustomize.py: vLLM's own tensor-parallel worker processes get the CUDA
platform at interpreter start (vLLM itself cannot be installed here: a stand-in package with
vLLM's ``builtin_platform_plugins`` table takes its place)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.peer_process import project_pythonpath
from bench.vllm_peer import FORCE_CUDA_ENV, VLLM_SITE

PROBE = "import vllm.platforms as p; print(p.builtin_platform_plugins['cuda']())"


def _run(tmp_path: Path, force: str | None) -> str:
    package = tmp_path / "vllm"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "platforms.py").write_text("builtin_platform_plugins = {'cuda': lambda: None}\n")
    env = {k: v for k, v in os.environ.items() if k != FORCE_CUDA_ENV}
    env["PYTHONPATH"] = project_pythonpath(str(VLLM_SITE)) + os.pathsep + str(tmp_path)
    if force is not None:
        env[FORCE_CUDA_ENV] = force
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_peers_processes_are_told_they_run_on_cuda(tmp_path: Path) -> None:
    assert _run(tmp_path, "1") == "vllm.platforms.cuda.CudaPlatform"


def test_other_processes_on_that_path_are_left_alone(tmp_path: Path) -> None:
    assert _run(tmp_path, None) == "None"
