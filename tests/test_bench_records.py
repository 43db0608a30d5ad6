"""Where the bench verbs write their records: a path that cannot be written is refused in one
line before the benchmark runs, and the matrix's --output-json may name a folder to make."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.records import check_writable
from tests.test_cli import SMALL_POOL, run_cli
from tests.test_cli_inputs import assert_one_line
from worker.errors import CommandError

# A model that cannot load: a verb that ran before checking its path would say so instead.
NO_MODEL = ["--model", "dummy:no-such-shape"]
VERBS = [
    ["throughput", *NO_MODEL],
    ["latency", *NO_MODEL],
    ["speculative", *NO_MODEL],
    ["kv-quality", *NO_MODEL],
    ["quant", *NO_MODEL],
    ["multiturn", *NO_MODEL],
    ["serve", *NO_MODEL, "--no-offline", "--vocab-size", "100"],
]


@pytest.mark.parametrize("verb", VERBS, ids=lambda verb: verb[0])
def test_an_unwritable_record_path_is_refused_before_the_run(
    verb: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "record.json"  # a folder that cannot be made
    code, out, err = run_cli(["bench", *verb, "--output-json", str(path)], capsys)
    assert code == 1 and out == ""
    assert_one_line(err, f"cannot write the record to {path}: {path.parent} is a file")


def test_an_unwritable_matrix_path_is_refused_before_the_first_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "matrix.json"
    args = [
        "bench", "matrix", "--models", "tiny", "--workloads", "tpot-b1", "--scale", "0.02",
        "--no-progress", "--output-json", str(path), *SMALL_POOL,
    ]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 1 and out == ""
    assert_one_line(err, f"cannot write the record to {path}: {path.parent} is a file")


def test_the_check_leaves_no_file_behind_and_an_existing_one_as_it_was(tmp_path: Path) -> None:
    new = tmp_path / "new" / "record.json"
    check_writable(new)
    assert new.parent.is_dir() and not new.exists()
    old = tmp_path / "old.json"
    old.write_text("{}")
    check_writable(old)
    assert old.read_text() == "{}"
    with pytest.raises(CommandError, match="Is a directory"):
        check_writable(tmp_path)


def test_a_matrix_path_with_a_trailing_slash_is_a_folder_to_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "new"
    args = [
        "bench", "matrix", "--models", "tiny", "--workloads", "tpot-b1", "--scale", "0.02",
        "--no-progress", "--output-json", f"{folder}/", *SMALL_POOL,
    ]  # fmt: skip
    code, _, _ = run_cli(args, capsys)
    assert code == 0
    record = json.loads((folder / "matrix-cpu-scale0.02.json").read_text())
    assert record["kind"] == "matrix" and [r["workload"] for r in record["results"]] == ["tpot-b1"]
