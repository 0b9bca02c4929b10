"""Regenerates the Python stubs (and their type stubs) from protos/ into gen/.

Run with ``python scripts/gen_protos.py``; ``--check`` fails if gen/ is stale.
The output mirrors the proto packages (agentim/im/v1/...), so the generated
absolute imports resolve with no patching once gen/ is on the path.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GEN = ROOT / "gen"


def generate(out: Path) -> None:
    # The mypy plugins are console scripts installed beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    out.mkdir(parents=True, exist_ok=True)
    # google/api (the HTTP annotations, vendored for protoc and buf) comes
    # generated with googleapis-common-protos.
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "agentim").rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Regular packages (not namespace packages) keep setuptools and mypy simple.
    for directory in [p for p in out.rglob("*") if p.is_dir()]:
        (directory / "__init__.py").touch()


def differences(left: Path, right: Path) -> list[str]:
    cmp = filecmp.dircmp(left, right)
    found = [f"only in {cmp.left}: {n}" for n in cmp.left_only]
    found += [f"only in {cmp.right}: {n}" for n in cmp.right_only]
    found += [f"differs: {Path(cmp.left, n)}" for n in cmp.diff_files]
    for sub in cmp.common_dirs:
        found += differences(left / sub, right / sub)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if gen/ is stale")
    options = parser.parse_args()
    if not options.check:
        shutil.rmtree(GEN / "agentim", ignore_errors=True)
        generate(GEN)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        fresh = Path(scratch)
        generate(fresh)
        stale = (
            differences(fresh / "agentim", GEN / "agentim")
            if (GEN / "agentim").exists()
            else ["gen/agentim is missing"]
        )
        stale = [s for s in stale if "__pycache__" not in s]
    if stale:
        print("generated stubs are stale; run `make gen`:", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
