"""Stage the vLLM peer kit (``shared/peers/vllm-0.26``) on a lent GPU over several device calls.

One device call carries at most 64 MiB: the working tree plus the folders it names. The kit is
about 110 MiB (vLLM in two xz chunks, its wheels, the MoE extension), and the tree itself
takes some of each call (11 MiB at the time of writing), so the kit's own recipe, whose first
call carries a 60 MiB chunk, no longer fits. This splits the kit into folders that fit beside
the tree (big files cut into byte ranges), and writes the script that puts it together on the
device:

    python -m bench.peer_stage --kit ../shared/peers/vllm-0.26 [--moe] [--extra-mib 1]

prints one device call per folder, to make back to back (a machine goes back 30 s after a
call ends): each copies its folder into ``/tmp/stage`` (kept between calls on a warm
machine), and the last runs ``/tmp/stage/setup.sh``, which joins the ranges, installs the
wheels into ``/tmp/vsite`` and unpacks vLLM there (once per machine). Then
``export PYTHONPATH=$PWD:/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0`` and ``--compare vllm``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
CALL_LIMIT_BYTES = 64 * MIB  # what one device call carries: tree and folders together
MARGIN_BYTES = 2 * MIB  # headroom for files written between staging and the calls
STAGE_DIR = "/tmp/stage"
SITE_DIR = "/tmp/vsite"
VLLM_CHUNKS = ("vllm026.part00", "vllm026.part01")  # one xz'd tar, cut in two
THIRD_PARTY = "third_party.tgz"
MOE_EXTENSION = "vllm026-moe.tar.xz"
PIECE_SEPARATOR = ".range"  # NAME.range00, NAME.range01, ... join back into NAME

SETUP_SCRIPT = f"""#!/usr/bin/env bash
# Written by bench/peer_stage.py: run on the device after every staging call has copied its
# folder into STAGE; joins the byte ranges, then installs the kit into SITE once per machine.
set -euo pipefail
STAGE=${{STAGE:-{STAGE_DIR}}} SITE=${{SITE:-{SITE_DIR}}}
cd "$STAGE"
for first in *{PIECE_SEPARATOR}00; do
    [ -e "$first" ] || continue
    name=${{first%{PIECE_SEPARATOR}00}}
    cat "$name"{PIECE_SEPARATOR}* > "$name.joined" && mv "$name.joined" "$name" && rm "$name"{PIECE_SEPARATOR}*
done
mkdir -p "$SITE"
if [ ! -f "$SITE/.ok" ]; then
    if compgen -G "*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
            --target "$SITE" ./*.whl
    fi
    cat {" ".join(VLLM_CHUNKS)} | xz -dc | tar -x -C "$SITE"
    tar -xzf {THIRD_PARTY} -C "$SITE"
    touch "$SITE/.ok"
fi
if [ -f {MOE_EXTENSION} ] && [ ! -f "$SITE/.moe-ok" ]; then
    tar -xJf {MOE_EXTENSION} -C "$SITE" && touch "$SITE/.moe-ok"
fi
echo "vLLM ready: export PYTHONPATH=\\$PWD:$SITE VLLM_USE_FLASHINFER_SAMPLER=0"
"""


@dataclass(frozen=True)
class Piece:
    """``size_bytes`` bytes of ``source`` from ``offset_bytes``, staged as ``name``."""

    source: Path
    name: str
    offset_bytes: int
    size_bytes: int


@dataclass
class Folder:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return sum(piece.size_bytes for piece in self.pieces)


def kit_files(kit: Path, moe: bool) -> list[Path]:
    """The kit's files a device needs, largest first; a missing one is a clear error."""
    names = [*VLLM_CHUNKS, THIRD_PARTY, *(MOE_EXTENSION,) * moe]
    files = [kit / name for name in names] + sorted((kit / "wheels").glob("*.whl"))
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise SystemExit(f"not in the kit: {', '.join(missing)} (--kit names the peer's folder)")
    return sorted(files, key=lambda path: -path.stat().st_size)


def cut(path: Path, room_bytes: int) -> list[Piece]:
    """``path`` whole, or in byte ranges of at most ``room_bytes`` when it is larger."""
    size = path.stat().st_size
    if size <= room_bytes:
        return [Piece(path, path.name, 0, size)]
    return [
        Piece(
            path, f"{path.name}{PIECE_SEPARATOR}{index:02d}", offset, min(room_bytes, size - offset)
        )
        for index, offset in enumerate(range(0, size, room_bytes))
    ]


def pack(files: list[Path], room_bytes: int) -> list[Folder]:
    """First fit, largest first: folders of at most ``room_bytes`` each."""
    folders: list[Folder] = []
    for path in files:
        for piece in cut(path, room_bytes):
            home = next((f for f in folders if f.size_bytes + piece.size_bytes <= room_bytes), None)
            if home is None:
                home = Folder()
                folders.append(home)
            home.pieces.append(piece)
    return folders


def tree_bytes(root: Path) -> int:
    """What every call carries anyway: tracked files and untracked ones git does not ignore."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = (root / name for name in listing.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def write(folders: list[Folder], dest: Path) -> list[Path]:
    """Each folder under ``dest`` (1, 2, ...), the setup script in the last."""
    written = []
    for number, folder in enumerate(folders, start=1):
        out = dest / str(number)
        out.mkdir(parents=True, exist_ok=True)
        for piece in folder.pieces:
            with piece.source.open("rb") as src, (out / piece.name).open("wb") as dst:
                src.seek(piece.offset_bytes)
                dst.write(src.read(piece.size_bytes))
        written.append(out)
    setup = written[-1] / "setup.sh"
    setup.write_text(SETUP_SCRIPT)
    setup.chmod(0o755)
    return written


def ignore(root: Path, dest: Path) -> None:
    """Keep ``dest`` out of git (so it travels only when a call carries it)."""
    found = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"],
        cwd=root, capture_output=True, check=True, text=True,
    )  # fmt: skip
    exclude = Path(found.stdout.strip())
    exclude = exclude if exclude.is_absolute() else root / exclude
    line = f"/{dest.resolve().relative_to(root.resolve())}/"
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if line not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("\n".join([*lines, line]) + "\n")


def calls(folders: list[Path], root: Path) -> list[tuple[str, str]]:
    """(carry, command) of each device call, in order."""
    out = []
    for index, folder in enumerate(folders):
        carry = str(folder.resolve().relative_to(root.resolve()))
        command = f"mkdir -p {STAGE_DIR} && cp -r {carry}/. {STAGE_DIR}/"
        if index == len(folders) - 1:
            command += f" && bash {STAGE_DIR}/setup.sh"
        out.append((carry, command))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", type=Path, required=True, help="the peer's folder")
    parser.add_argument("--moe", action="store_true", help="also vLLM's MoE extension")
    parser.add_argument("--dest", type=Path, default=Path(".peer"), help="default .peer")
    parser.add_argument(
        "--extra-mib", type=float, default=0.0,
        help="other folders the calls carry too (e.g. scripts), MiB",
    )  # fmt: skip
    args = parser.parse_args(argv)
    root = Path.cwd()
    room_bytes = CALL_LIMIT_BYTES - MARGIN_BYTES - tree_bytes(root) - int(args.extra_mib * MIB)
    if room_bytes < 4 * MIB:
        raise SystemExit(f"the tree leaves {room_bytes / MIB:.1f} MiB a call: too little to stage")
    folders = pack(kit_files(args.kit, args.moe), room_bytes)
    ignore(root, args.dest)
    written = write(folders, args.dest)
    print(f"{len(written)} device calls, back to back, {room_bytes / MIB:.1f} MiB of kit each:")
    for carry, command in calls(written, root):
        print(f'  carry ["{carry}"]: {command}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
