"""Every flag from its ``PAGESTREAM_*`` environment variable; the command line wins."""

from __future__ import annotations

import argparse

import pytest

from commands import build_parser, main


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_variables_set_engine_and_service_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGESTREAM_MODEL", "dummy:tiny")
    monkeypatch.setenv("PAGESTREAM_MAX_SEQS", "64")
    monkeypatch.setenv("PAGESTREAM_PA_MEMORY_FRACTION", "0.5")
    monkeypatch.setenv("PAGESTREAM_PREFIX_CACHING", "0")
    monkeypatch.setenv("PAGESTREAM_CUDA_GRAPHS", "off")
    monkeypatch.setenv("PAGESTREAM_TENANT_QUOTA", "a=10, b=20")
    monkeypatch.setenv("PAGESTREAM_REDIS_URL", "redis://redis:6379/1")
    monkeypatch.setenv("PAGESTREAM_LEASE_S", "12.5")
    monkeypatch.setenv("PAGESTREAM_MAX_OUTPUT_TOKENS", "")  # empty = unset
    args = _parse(["worker"])
    assert (args.model, args.max_seqs, args.pa_memory_fraction) == ("dummy:tiny", 64, 0.5)
    assert args.prefix_caching is False and args.cuda_graphs is False
    assert args.tenant_quota == [("a", 10), ("b", 20)]
    assert (args.redis_url, args.lease_s, args.max_output_tokens) == (
        "redis://redis:6379/1", 12.5, None,
    )  # fmt: skip


def test_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGESTREAM_MAX_SEQS", "64")
    monkeypatch.setenv("PAGESTREAM_PA_MEMORY_FRACTION", "0.5")
    args = _parse(["worker", "--max-seqs", "8", "--pa-memory-mb", "256"])
    assert args.max_seqs == 8
    # A flag of a mutually exclusive group given on the command line clears the variable's.
    assert (args.pa_memory_mb, args.pa_memory_fraction) == (256, None)


def test_switches_take_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGESTREAM_DEMO", "yes")
    assert _parse(["up"]).demo is True
    monkeypatch.setenv("PAGESTREAM_DEMO", "false")
    assert _parse(["up"]).demo is False


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PAGESTREAM_MAX_SEQS", "many", "PAGESTREAM_MAX_SEQS='many': invalid int value"),
        ("PAGESTREAM_DTYPE", "fp4", "PAGESTREAM_DTYPE='fp4': invalid choice 'fp4'"),
        ("PAGESTREAM_CUDA_GRAPHS", "maybe", "PAGESTREAM_CUDA_GRAPHS='maybe': expected on or off"),
        ("PAGESTREAM_DEMO", "2", "PAGESTREAM_DEMO='2': expected 1/0, true/false"),
        ("PAGESTREAM_TENANT_QUOTA", "a=x", "PAGESTREAM_TENANT_QUOTA='a=x': expected TENANT=PAGES"),
    ],
)
def test_a_bad_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
    message: str,
) -> None:
    monkeypatch.setenv(name, value)
    command = "up" if name == "PAGESTREAM_DEMO" else "worker"
    assert main([command]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"pagestream {command}: error: {message}")


def test_two_budget_variables_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGESTREAM_PA_MEMORY_MB", "512")
    monkeypatch.setenv("PAGESTREAM_PA_CONTEXT_LEN", "4096")
    assert main(["worker"]) == 2
    assert "PAGESTREAM_PA_MEMORY_MB and PAGESTREAM_PA_CONTEXT_LEN are mutually exclusive" in (
        capsys.readouterr().err
    )


def test_help_names_each_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in ("PAGESTREAM_MODEL", "PAGESTREAM_GRACE_S", "PAGESTREAM_REDIS_URL"):
        assert f"[env {name}]" in help_text


def test_clamping_is_off_unless_asked_and_the_output_limit_says_its_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.config_flags import engine_config_from_args

    assert engine_config_from_args(_parse(["worker"])).clamp_max_tokens is False
    monkeypatch.setenv("PAGESTREAM_CLAMP_MAX_TOKENS", "1")
    assert engine_config_from_args(_parse(["worker"])).clamp_max_tokens is True
    assert main(["worker", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "default: no limit but the model's context [env PAGESTREAM_MAX_OUTPUT_TOKENS]" in (
        help_text
    )
