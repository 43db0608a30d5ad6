"""bench/peer_stage.py: the vLLM kit cut into folders that fit a device call, and put back
together by the setup script it writes (run here on a small kit of the same layout)."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Literal

import pytest

from bench import peer_stage


def _tar(path: Path, members: dict[str, bytes], mode: Literal["w:xz", "w:gz"]) -> None:
    with tarfile.open(path, mode) as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _kit(root: Path) -> tuple[Path, bytes]:
    """A kit laid out as shared/peers/vllm-0.26: an xz'd tar cut in two, third_party.tgz, the
    MoE extension, a wheels folder. Returns it and the vLLM module's bytes."""
    kit = root / "kit"
    (kit / "wheels").mkdir(parents=True)
    module = random.Random(0).randbytes(300_000)  # incompressible: the chunks stay large
    _tar(kit / "vllm.tar.xz", {"vllm/__init__.py": module}, "w:xz")
    whole = (kit / "vllm.tar.xz").read_bytes()
    half = len(whole) // 2
    (kit / peer_stage.VLLM_CHUNKS[0]).write_bytes(whole[:half])
    (kit / peer_stage.VLLM_CHUNKS[1]).write_bytes(whole[half:])
    (kit / "vllm.tar.xz").unlink()
    _tar(kit / peer_stage.THIRD_PARTY, {"third/mod.py": b"x = 1\n"}, "w:gz")
    _tar(kit / peer_stage.MOE_EXTENSION, {"vllm/_moe_C.so": b"moe"}, "w:xz")
    return kit, module


def test_pack_fits_every_folder_in_its_room_and_cuts_only_what_is_larger(tmp_path: Path) -> None:
    kit, _ = _kit(tmp_path)
    files = peer_stage.kit_files(kit, moe=True)
    room_bytes = 100_000
    folders = peer_stage.pack(files, room_bytes)
    assert all(0 < folder.size_bytes <= room_bytes for folder in folders)
    pieces = [piece for folder in folders for piece in folder.pieces]
    for path in files:  # each file's pieces cover it exactly, in order
        own = [p for p in pieces if p.source == path]
        assert [p.offset_bytes for p in own] == sorted(p.offset_bytes for p in own)
        assert sum(p.size_bytes for p in own) == path.stat().st_size
        if path.stat().st_size <= room_bytes:
            assert [p.name for p in own] == [path.name]
        else:
            sep = peer_stage.PIECE_SEPARATOR
            assert [p.name for p in own] == [f"{path.name}{sep}{i:02d}" for i in range(len(own))]


def test_the_setup_script_puts_the_kit_back_together(tmp_path: Path) -> None:
    if shutil.which("xz") is None:
        pytest.skip("no xz on this host")
    kit, module = _kit(tmp_path)
    folders = peer_stage.pack(peer_stage.kit_files(kit, moe=True), room_bytes=120_000)
    assert len(folders) >= 3  # the chunks were cut
    written = peer_stage.write(folders, tmp_path / "staged")
    stage, site = tmp_path / "stage", tmp_path / "site"
    stage.mkdir()
    for folder in written:  # what each device call does, in order
        shutil.copytree(folder, stage, dirs_exist_ok=True)
    env = {**os.environ, "STAGE": str(stage), "SITE": str(site)}
    run = subprocess.run(["bash", str(stage / "setup.sh")], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (site / "vllm" / "__init__.py").read_bytes() == module
    assert (site / "vllm" / "_moe_C.so").read_bytes() == b"moe"
    assert (site / "third" / "mod.py").read_text() == "x = 1\n"
    assert not list(stage.glob(f"*{peer_stage.PIECE_SEPARATOR}*"))  # ranges joined
    again = subprocess.run(["bash", str(stage / "setup.sh")], env=env, capture_output=True)
    assert again.returncode == 0  # a second call on the same machine installs nothing twice


def test_a_kit_missing_a_file_says_which(tmp_path: Path) -> None:
    kit, _ = _kit(tmp_path)
    (kit / peer_stage.THIRD_PARTY).unlink()
    with pytest.raises(SystemExit, match=r"third_party\.tgz"):
        peer_stage.kit_files(kit, moe=False)


def test_the_calls_copy_each_folder_and_the_last_runs_setup(tmp_path: Path) -> None:
    folders = [tmp_path / ".peer" / "1", tmp_path / ".peer" / "2"]
    calls = peer_stage.calls(folders, tmp_path)
    assert [carry for carry, _ in calls] == [".peer/1", ".peer/2"]
    assert "setup.sh" not in calls[0][1]
    assert calls[1][1].endswith(f"bash {peer_stage.STAGE_DIR}/setup.sh")
