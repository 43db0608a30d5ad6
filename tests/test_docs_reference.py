"""docs/configuration.md against the CLI itself, so neither drifts: every flag of every command
is documented in that command's section and every documented flag exists; every environment
variable the code reads is documented, and every documented one is read. The checks are plain
functions of the document's text, so the last tests can show that they fail on a document with
a flag or a variable taken out."""

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
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
PACKAGES = ("engine", "kernels", "worker", "clients", "bench")
SOURCES = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
ENGINE_LINK = "[engine flag](#engine-flags)"
VERB_TABLE_GROUPS = ("batch", "bench")  # sections whose table has a verb column
# variables of flags that the table lists too, for what they mean beyond their flag
FLAG_VARIABLES_ALSO_LISTED = {"PAGESTREAM_DEVICE", "PAGESTREAM_CUDA_GRAPHS", "PAGESTREAM_ROUTING"}


def leaf_commands() -> dict[str, argparse.ArgumentParser]:
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


COMMANDS = leaf_commands()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {max(a.option_strings, key=len) for a in flag_actions(parser)}


def _engine_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return _flags(parser)


def _section(doc: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of that level or above."""
    start = doc.index(f"\n## {heading}\n")
    end = re.compile(r"^#{1,2} ", re.M).search(doc, start + 4)
    return doc[start : end.start() if end else len(doc)]


def _rows(text: str) -> list[list[str]]:
    """Table rows (header and rule lines left out) as lists of cells."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]  # fmt: skip
    return [r for r in rows[2:] if r and not set(r[0]) <= {"-"}] if rows else []


def _code_flags(text: str) -> set[str]:
    """Flags written in backticks: ``--max-seqs N`` counts, prose does not."""
    return {f for span in re.findall(r"`([^`]*)`", text) for f in FLAG.findall(span)}


def documented_flags(doc: str, command: str) -> set[str]:
    """The flags ``doc`` gives ``pagestream {command}``: its section's backticked flags (and
    the engine flags where it links them), or for verb groups the rows naming its verb."""
    group, _, verb = command.partition(" ")
    if group not in VERB_TABLE_GROUPS:
        text = _section(doc, f"`pagestream {command}`")
        return _code_flags(text) | (_engine_flags() if ENGINE_LINK in text else set())
    verbs = {name.split(" ", 1)[1] for name in COMMANDS if name.startswith(f"{group} ")}
    flags: set[str] = set()
    for row in _rows(_section(doc, f"`pagestream {group}`")):
        if len(row) < 4:  # the table of what each verb measures
            continue
        named = set(re.findall(r"`([a-z-]+)`", row[0]))
        applies = verbs - named if row[0].startswith("all") else named
        if verb in applies:
            flags |= _code_flags(row[1]) | (_engine_flags() if ENGINE_LINK in row[1] else set())
    return flags


def flag_drift(doc: str, command: str) -> tuple[set[str], set[str]]:
    """(flags the parser has and ``doc`` lacks, flags ``doc`` names and the parser lacks)."""
    actual, documented = _flags(COMMANDS[command]), documented_flags(doc, command)
    return actual - documented, documented - actual


def engine_table_drift(doc: str) -> set[str]:
    """Engine flags missing from the engine flag table, or listed there and not flags."""
    rows = _rows(_section(doc, "Engine flags"))
    return {f for row in rows for f in _code_flags(row[0])} ^ _engine_flags()


def variables_read() -> set[str]:
    return {
        name
        for path in SOURCES
        for name in re.findall(r"\b(PAGESTREAM_[A-Z0-9_]+[A-Z0-9])\b", path.read_text())
    }


def variable_drift(doc: str) -> tuple[set[str], set[str]]:
    """(variables the code reads that ``doc`` lacks, ``PAGESTREAM_*`` variables ``doc`` lists
    that nothing reads). A flag's own variable needs no row: the rule above the table covers it."""
    flag_variables = {env_var(a) for parser in COMMANDS.values() for a in flag_actions(parser)}
    table = {name for row in _rows(_section(doc, "Environment variables"))
             for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}  # fmt: skip
    in_code = variables_read()
    listed_ours = {name for name in table if name.startswith(ENV_PREFIX)}
    return in_code - flag_variables - table, listed_ours - in_code


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_each_command_is_documented_and_exists(command: str) -> None:
    undocumented, nonexistent = flag_drift(CONFIGURATION, command)
    assert undocumented == set(), f"flags of `pagestream {command}` missing from configuration.md"
    assert nonexistent == set(), f"configuration.md documents flags `pagestream {command}` lacks"


def test_the_engine_flag_table_is_exactly_the_engine_flags() -> None:
    assert engine_table_drift(CONFIGURATION) == set()


@pytest.mark.parametrize("command", ["up", "worker", "generate", "submit", "health"])
def test_numeric_defaults_match_the_parser(command: str) -> None:
    """A default column that is a plain number equals the parser's default."""
    parser = COMMANDS[command]
    by_flag = {max(a.option_strings, key=len): a for a in flag_actions(parser)}
    checked = 0
    for row in _rows(_section(CONFIGURATION, f"`pagestream {command}`")):
        flags = _code_flags(row[0])
        if len(flags) != 1 or not re.fullmatch(r"-?\d+(\.\d+)?", row[-1]):
            continue
        action = by_flag[flags.pop()]
        if action.default is not None:
            assert float(row[-1]) == float(action.default), row
            checked += 1
    assert checked >= 1


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    unlisted, unread = variable_drift(CONFIGURATION)
    assert unlisted == set(), "read by the code, not in configuration.md"
    assert unread == set(), "in configuration.md, read by nothing"
    table = _section(CONFIGURATION, "Environment variables")
    flag_variables = {env_var(a) for parser in COMMANDS.values() for a in flag_actions(parser)}
    listed = set(re.findall(r"`(PAGESTREAM_[A-Z_]+)`", table))
    assert listed & flag_variables <= FLAG_VARIABLES_ALSO_LISTED


# -- the checks can fail -----------------------------------------------------------------------


def _without_row(doc: str, cell: str) -> str:
    """``doc`` with the one table row that starts with ``cell`` taken out."""
    lines = doc.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.startswith(f"| {cell}")]
    assert len(hits) == 1, f"expected one row starting {cell!r}, found {len(hits)}"
    del lines[hits[0]]
    return "".join(lines)


@pytest.mark.parametrize(
    ("command", "row", "flag"),
    [
        ("worker", "`--lease-s S`", "--lease-s"),
        ("gateway", "`--max-body-bytes N`", "--max-body-bytes"),
        ("bench serve", "`serve` | `--concurrency N`", "--concurrency"),
        ("batch result", "`result` | `--output FILE`", "--output"),
    ],
)
def test_a_flag_taken_out_of_the_document_fails_the_check(
    command: str, row: str, flag: str
) -> None:
    assert flag_drift(CONFIGURATION, command) == (set(), set())
    undocumented, _ = flag_drift(_without_row(CONFIGURATION, row), command)
    assert undocumented == {flag}


def test_an_engine_flag_taken_out_of_the_table_fails_the_check() -> None:
    assert engine_table_drift(_without_row(CONFIGURATION, "`--prefill-chunk N`")) == {
        "--prefill-chunk"
    }


def test_a_flag_the_parser_lacks_fails_the_check() -> None:
    doc = CONFIGURATION.replace(
        "| `--lease-s S` |", "| `--no-such-flag` | made up | |\n| `--lease-s S` |", 1
    )
    assert flag_drift(doc, "worker") == (set(), {"--no-such-flag"})


def test_a_variable_taken_out_or_made_up_fails_the_check() -> None:
    unlisted, _ = variable_drift(_without_row(CONFIGURATION, "`PAGESTREAM_TP_TIMEOUT_S`"))
    assert unlisted == {"PAGESTREAM_TP_TIMEOUT_S"}
    doc = CONFIGURATION.replace(
        "| `PAGESTREAM_PDL` |", "| `PAGESTREAM_MADE_UP` | nothing |\n| `PAGESTREAM_PDL` |", 1
    )
    assert variable_drift(doc) == (set(), {"PAGESTREAM_MADE_UP"})
