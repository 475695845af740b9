"""Project-wide rules that every change must keep."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_FORBIDDEN = re.compile(r"^\s*(import|from)\s+(pickle|msgpack|marshal|cloudpickle|dill)\b", re.M)


def _project_python_files() -> list[Path]:
    dirs = ["services", "connector", "tests", "bench", "deploy", "protos"]
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts]


def test_no_pickle_msgpack_or_marshal_imports() -> None:
    offenders = [str(p) for p in _project_python_files() if _FORBIDDEN.search(p.read_text())]
    assert offenders == []


# vLLM's KV cache events arrive as msgpack over a ZMQ socket private to the instance: exactly one
# module reads them (with vLLM's own typed decoder) and turns them into the typed gRPC stream.
_ENGINE_EVENT_IMPORTS = re.compile(r"^\s*(import|from)\s+(msgspec|zmq)\b", re.M)
_ENGINE_EVENT_READER = ROOT / "connector" / "pdplane" / "connector" / "kv_events.py"


def test_only_the_kv_event_reader_touches_zmq_or_msgspec() -> None:
    users = [p for p in _project_python_files() if _ENGINE_EVENT_IMPORTS.search(p.read_text())]
    assert users == [_ENGINE_EVENT_READER]
    reader = _ENGINE_EVENT_READER.read_text()
    assert "Decoder(type=KVEventBatch)" in reader  # typed decoding only, never a generic one
    assert not re.search(r"\.(bind|send|send_multipart)\(", reader)  # it only reads


# bench/ is a package: its scripts and the tests import `bench.<module>` with the checkout root
# on the path (pyproject.toml: the editable install's dev-mode-dirs, pytest's pythonpath), never
# by editing sys.path at import time.
_PATH_EDIT = re.compile(r"\bsys\.path\.(insert|append|extend)\(|\bsys\.path\s*(\+=|=[^=])")


def test_no_python_file_edits_sys_path() -> None:
    files = [p for p in _project_python_files() if p != Path(__file__).resolve()]
    assert [str(p) for p in files if _PATH_EDIT.search(p.read_text())] == []
    for line in ("sys.path.insert(0, ROOT)", "sys.path.append(x)", "sys.path = [x]"):
        assert _PATH_EDIT.search(line), line
    assert not _PATH_EDIT.search("if str(ROOT) not in sys.path:")


def test_forbidden_import_pattern_catches_offenders() -> None:
    # Guards the guard: the pattern must match the forms it is meant to forbid.
    for line in ("import pickle", "from msgpack import packb", "  import marshal"):
        assert _FORBIDDEN.search(line), line
    assert not _FORBIDDEN.search("import pickled_thing_name_only_prefix_is_fine")


def test_generated_protobuf_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# A user reads a docs page through; a page past this is a subject to split (docs/benchmarks/
# holds one page per subject for the measurements).
_DOCS_PAGE_MAX_LINES = 400


def test_no_docs_page_is_longer_than_the_bound() -> None:
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert pages
    long = {
        str(p.relative_to(ROOT)): n
        for p in pages
        if (n := len(p.read_text().splitlines())) > _DOCS_PAGE_MAX_LINES
    }
    assert long == {}
