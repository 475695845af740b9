"""Regenerates the Python code for every proto under protos/ into services/.

Usage (from the repository root, in the project's environment):
    python protos/generate.py            # write services/pdplane/v1/*_pb2*.py(i)
    python protos/generate.py --check    # exit 1 if the committed code is stale

Needs grpcio-tools and mypy-protobuf (the `dev` extra). The output of one pinned grpcio-tools
version is deterministic, which is what makes --check meaningful.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "services"
PACKAGE_DIR = Path("pdplane") / "v1"


def _generate(out: Path) -> None:
    # protoc finds the mypy plugins on PATH; they live beside this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto")
    )
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--mypy_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        "--fatal_warnings",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def _generated_files(base: Path) -> set[str]:
    return {p.name for p in (base / PACKAGE_DIR).glob("*_pb2*.py*")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / PACKAGE_DIR).mkdir(parents=True)
        _generate(out)
        fresh = _generated_files(out)
        if opts.check:
            committed = _generated_files(OUT_ROOT)
            stale = sorted(
                n
                for n in fresh | committed
                if n not in fresh
                or n not in committed
                or not filecmp.cmp(out / PACKAGE_DIR / n, OUT_ROOT / PACKAGE_DIR / n, shallow=False)
            )
            if stale:
                print("stale generated code (run `python protos/generate.py`):", *stale, sep="\n  ")
                return 1
            print(f"generated code is current ({len(fresh)} files)")
            return 0
        for name in _generated_files(OUT_ROOT) - fresh:
            (OUT_ROOT / PACKAGE_DIR / name).unlink()
        for name in fresh:
            shutil.copyfile(out / PACKAGE_DIR / name, OUT_ROOT / PACKAGE_DIR / name)
        print(f"wrote {len(fresh)} files to {OUT_ROOT / PACKAGE_DIR}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
