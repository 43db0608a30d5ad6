"""The README's configuration reference against the CLI itself, so neither drifts: every flag
of every command is documented in that command's section and every documented flag exists;
every environment variable the code reads is documented, and every documented one is read."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from commands import build_parser
from commands.parser import LazyParser
from engine.config_flags import add_engine_args
from worker.env_flags import ENV_PREFIX, env_var, flag_actions

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SOURCES = [p for package in ("engine", "kernels", "worker", "clients") for p in (ROOT / package).rglob("*.py")]  # fmt: skip
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
ENGINE_LINK = "[engine flag](#engine-flags)"
VERB_TABLE_GROUPS = ("batch", "bench")  # sections whose table has a verb column


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every leaf command ("worker", "bench serve", ...) and its configured parser."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        if isinstance(parser, LazyParser):
            parser._ensure_configured()
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[" ".join(path)] = parser
            return
        for name, sub in subs[0].choices.items():
            walk(sub, [*path, name])

    walk(build_parser(), [])
    return found


COMMANDS = _commands()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {max(a.option_strings, key=len) for a in flag_actions(parser)}


def _engine_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return _flags(parser)


def _section(heading: str) -> str:
    """The README text under ``### heading`` up to the next heading."""
    start = README.index(f"### {heading}\n")
    end = re.compile(r"^#{2,3} ", re.M).search(README, start + 4)
    return README[start : end.start() if end else len(README)]


def _rows(text: str) -> list[list[str]]:
    """Table rows (header and rule lines left out) as lists of cells."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]  # fmt: skip
    return [r for r in rows[2:] if r and not set(r[0]) <= {"-"}] if rows else []


def _code_flags(text: str) -> set[str]:
    """Flags written in backticks: ``--max-seqs N`` counts, prose does not."""
    return {f for span in re.findall(r"`([^`]*)`", text) for f in FLAG.findall(span)}


def _documented_flags(command: str) -> set[str]:
    group, _, verb = command.partition(" ")
    if group not in VERB_TABLE_GROUPS:
        text = _section(f"`pagestream {command}`")
        return _code_flags(text) | (_engine_flags() if ENGINE_LINK in text else set())
    verbs = {name.split(" ", 1)[1] for name in COMMANDS if name.startswith(f"{group} ")}
    flags: set[str] = set()
    for row in _rows(_section(f"`pagestream {group}`")):
        if len(row) < 4:  # the table of what each verb measures
            continue
        named = set(re.findall(r"`([a-z-]+)`", row[0]))
        applies = verbs - named if row[0].startswith("all") else named
        if verb in applies:
            flags |= _code_flags(row[1]) | (_engine_flags() if ENGINE_LINK in row[1] else set())
    return flags


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_each_command_is_documented_and_exists(command: str) -> None:
    actual = _flags(COMMANDS[command])
    documented = _documented_flags(command)
    assert actual - documented == set(), f"undocumented flags of `pagestream {command}`"
    assert documented - actual == set(), f"documented flags `pagestream {command}` lacks"


def test_the_engine_flag_table_is_exactly_the_engine_flags() -> None:
    rows = _rows(_section("Engine flags"))
    assert {f for row in rows for f in _code_flags(row[0])} == _engine_flags()


@pytest.mark.parametrize("command", ["up", "worker", "generate", "submit", "health"])
def test_numeric_defaults_match_the_parser(command: str) -> None:
    """A default column that is a plain number equals the parser's default."""
    parser = COMMANDS[command]
    by_flag = {max(a.option_strings, key=len): a for a in flag_actions(parser)}
    checked = 0
    for row in _rows(_section(f"`pagestream {command}`")):
        flags = _code_flags(row[0])
        if len(flags) != 1 or not re.fullmatch(r"-?\d+(\.\d+)?", row[-1]):
            continue
        action = by_flag[flags.pop()]
        if action.default is not None:
            assert float(row[-1]) == float(action.default), row
            checked += 1
    assert checked >= 1


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    flag_variables = {env_var(a) for parser in COMMANDS.values() for a in flag_actions(parser)}
    in_code = {
        name
        for path in SOURCES
        for name in re.findall(r"\b(PAGESTREAM_[A-Z_]+[A-Z])\b", path.read_text())
    }
    table = {name for row in _rows(_section("Environment variables"))
             for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}  # fmt: skip
    assert in_code - flag_variables - table == set(), "read by the code, not in the README"
    documented_ours = {name for name in table if name.startswith(ENV_PREFIX)}
    assert documented_ours - in_code == set(), "in the README, read by nothing"
    assert documented_ours & flag_variables <= {"PAGESTREAM_DEVICE", "PAGESTREAM_CUDA_GRAPHS"}
