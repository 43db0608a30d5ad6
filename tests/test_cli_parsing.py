"""How the ``pagestream`` commands read their words: no abbreviated flags, a mistake answered
with the usage of the command that was typed, one meaning per ``PAGESTREAM_*`` variable, and
pasteable commands in what they print."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import pytest

from commands import main
from commands.parser import invocation
from engine.config_flags import add_engine_args
from tests.test_docs_reference import leaf_commands
from worker.env_flags import env_var, flag_actions

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("commands", "worker", "bench", "clients", "engine", "kernels")
# Deployments configure these commands through the environment (compose.yaml, `up`)
SERVICE_COMMANDS = ("up", "worker", "gateway")
# Variables these commands share on purpose: the same setting under the same name
SHARED_ON_PURPOSE = {"PAGESTREAM_PREFIX", "PAGESTREAM_REDIS_URL", "PAGESTREAM_GRACE_S",
                     "PAGESTREAM_LOG_LEVEL", "PAGESTREAM_ROUTING", "PAGESTREAM_SHARDS",
                     "PAGESTREAM_REDIS_CLUSTER"}  # fmt: skip


# -- abbreviations -----------------------------------------------------------------------------


def test_an_abbreviated_flag_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--max-token", "5"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-token 5" in err
    assert err.startswith("usage: pagestream generate")


def test_every_command_and_script_parser_refuses_abbreviations() -> None:
    assert all(parser.allow_abbrev is False for parser in leaf_commands().values())
    # The `python -m bench.*` scripts build plain parsers: each must say so itself
    lenient = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and _calls_argument_parser(node):
                    words = {k.arg: k.value for k in node.keywords}
                    value = words.get("allow_abbrev")
                    if not (isinstance(value, ast.Constant) and value.value is False):
                        lenient.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert lenient == []


def _calls_argument_parser(node: ast.Call) -> bool:
    func = node.func
    return isinstance(func, ast.Attribute) and func.attr == "ArgumentParser"


# -- the usage of the command that was typed ---------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["submit", "hi", "--bogus"], "usage: pagestream submit"),
        (["batch", "status", "job-1", "--bogus"], "usage: pagestream batch status"),
        (["bench", "kernels", "--bogus"], "usage: pagestream bench kernels"),
    ],
)
def test_an_unknown_flag_shows_the_subcommands_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "unrecognized arguments: --bogus" in err


# -- one name, one meaning ---------------------------------------------------------------------


def test_service_commands_share_a_variable_only_for_the_same_setting() -> None:
    parsers = leaf_commands()
    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    engine_vars = {env_var(action) for action in flag_actions(engine)}
    owners: dict[str, list[str]] = {}
    for command in SERVICE_COMMANDS:
        for action in flag_actions(parsers[command]):
            owners.setdefault(env_var(action), []).append(command)
    shared = {name for name, commands in owners.items() if len(commands) > 1}
    assert shared - engine_vars - SHARED_ON_PURPOSE == set()


def test_up_names_its_redis_port_and_the_gateway_its_http_port() -> None:
    parsers = leaf_commands()
    up = {env_var(a): a.dest for a in flag_actions(parsers["up"])}
    gateway = {env_var(a): a.dest for a in flag_actions(parsers["gateway"])}
    assert up["PAGESTREAM_REDIS_PORT"] == "redis_port"
    assert up["PAGESTREAM_GATEWAY_PORT"] == "gateway_port"
    assert gateway["PAGESTREAM_PORT"] == "port"
    assert "PAGESTREAM_PORT" not in up


# -- commands to paste -------------------------------------------------------------------------


def test_printed_commands_name_the_virtualenvs_programs_when_path_does_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "pagestream").exists():
        pytest.skip("no installed pagestream script beside this Python")
    checkout = bin_dir.parent.parent
    relative = str(bin_dir.relative_to(checkout)) if bin_dir.is_relative_to(checkout) else None

    monkeypatch.setenv("PATH", str(tmp_path))  # a shell that has not activated the venv
    pagestream, python = invocation(cwd=checkout)
    assert pagestream == f"{relative}/pagestream"
    assert python == f"{relative}/{Path(sys.executable).name}"
    assert invocation(cwd=tmp_path)[0] == str(bin_dir / "pagestream")

    monkeypatch.setenv("PATH", str(bin_dir))  # activated
    assert invocation(cwd=checkout) == ("pagestream", Path(sys.executable).name)


def test_the_up_banner_uses_those_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from commands.up import _banner

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(
        redis_port=0, prefix="pagestream", model="smollm2-135m", redis_cluster_primaries=0
    )
    banner = _banner("redis://127.0.0.1:5555/0", tmp_path, args, gateway=None)
    pagestream, python = invocation()
    assert pagestream != "pagestream"
    commands = [line.strip() for line in banner.splitlines() if line.startswith("  ")]
    assert commands and all(
        re.match(rf"({re.escape(pagestream)}|{re.escape(python)}) ", line) for line in commands
    ), commands
