"""Every flag from the environment: ``--max-seqs 64`` is also ``PAGESTREAM_MAX_SEQS=64``.

Containers and process managers configure a worker through its environment (``compose.yaml``
passes the model and engine flags this way). The variable is ``PAGESTREAM_`` plus the flag's
name upper-cased with ``-`` as ``_``; a flag given on the command line wins over its variable,
and an empty variable counts as unset. Switches (``on/off`` flags and flags without a value)
take ``1/0``, ``true/false``, ``yes/no`` or ``on/off``; repeatable flags take a
comma-separated list. A value the flag would refuse is a usage error that names the variable.
A variable counts as given for a choice the command requires (``PAGESTREAM_INPUT`` for
``generate``'s prompt or ``--input``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "PAGESTREAM_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def env_var(action: argparse.Action) -> str:
    """The variable that sets ``action``'s flag: ``--pa-block-size`` -> ``PAGESTREAM_PA_BLOCK_SIZE``."""
    flag = max(action.option_strings, key=len)  # the long form
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's flags that take part: every optional argument except ``--help``."""
    return [
        action
        for action in parser._actions  # argparse keeps no public list of its actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    ]


def apply_env_defaults(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Make each set variable its flag's default; returns the dests set, with the defaults they
    replaced (for :func:`resolve_exclusive`). Every flag's help names its variable."""
    environ = os.environ if environ is None else environ
    replaced: dict[str, Any] = {}
    for action in flag_actions(parser):
        name = env_var(action)
        if action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {name}]".lstrip()
        text = environ.get(name, "").strip()
        if not text:
            continue
        try:
            value = _parse(parser, action, text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"{name}={text!r}: {exc}")
        replaced[action.dest] = action.default
        action.default = value
    _check_exclusive_env(parser, replaced)
    _satisfy_required_groups(parser, replaced)
    return replaced


def resolve_exclusive(
    parser: argparse.ArgumentParser, namespace: argparse.Namespace, replaced: Mapping[str, Any]
) -> None:
    """A flag given on the command line beats a variable of its mutually exclusive group: the
    variable's flag goes back to its own default (``--pa-memory-mb`` over
    ``PAGESTREAM_PA_MEMORY_FRACTION``)."""
    for group in parser._mutually_exclusive_groups:
        members = group._group_actions
        explicit = [
            a for a in members if a.dest not in replaced and getattr(namespace, a.dest) != a.default
        ]
        if explicit:
            for action in members:
                if action.dest in replaced:
                    setattr(namespace, action.dest, replaced[action.dest])


def _check_exclusive_env(parser: argparse.ArgumentParser, replaced: Mapping[str, Any]) -> None:
    for group in parser._mutually_exclusive_groups:
        names = [env_var(a) for a in group._group_actions if a.dest in replaced]
        if len(names) > 1:
            parser.error(f"{' and '.join(names)} are mutually exclusive: set at most one")


def _satisfy_required_groups(parser: argparse.ArgumentParser, replaced: Mapping[str, Any]) -> None:
    # argparse checks a required group against the command line only, so a variable that sets
    # one of its flags (PAGESTREAM_INPUT for generate's prompt or --input) must count as given
    for group in parser._mutually_exclusive_groups:
        if group.required and any(a.dest in replaced for a in group._group_actions):
            group.required = False


def _parse(parser: argparse.ArgumentParser, action: argparse.Action, text: str) -> Any:
    if action.nargs == 0:  # a switch (store_true and friends): given or not
        return action.const if _switch(text) else action.default
    if isinstance(action, argparse._AppendAction):
        items = [item.strip() for item in text.split(",") if item.strip()]
        return [_convert(parser, action, item) for item in items]
    return _convert(parser, action, text)


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, text: str) -> Any:
    convert = parser._registry_get("type", action.type, action.type)
    if not callable(convert):
        raise ValueError(f"{action.type!r} is not callable")
    try:
        value = convert(text)
    except (TypeError, ValueError):  # what argparse itself says for int("abc") and the like
        raise ValueError(f"invalid {getattr(action.type, '__name__', 'str')} value") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    return value


def _switch(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")
