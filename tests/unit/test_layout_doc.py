"""docs/layout.md describes every source folder and every `pdplane` command: adding either
without a line there fails here."""

from __future__ import annotations

from pathlib import Path

from pdplane.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (ROOT / "docs" / "layout.md").read_text()


def _source_folders() -> list[str]:
    folders = []
    for top in (ROOT / "services" / "pdplane", ROOT / "connector" / "pdplane"):
        for init in sorted(top.rglob("*.py")):
            folder = init.parent
            if "__pycache__" in folder.parts or folder.name == "v1":
                continue
            folders.append(f"{folder.relative_to(ROOT).as_posix()}/")
    return sorted(set(folders))


def test_every_source_folder_is_described() -> None:
    missing = [f for f in _source_folders() if f"`{f}`" not in LAYOUT]
    assert not missing, f"docs/layout.md does not describe {missing}"


def test_every_command_is_listed() -> None:
    missing = [name for name in COMMANDS if f"| `pdplane {name}` |" not in LAYOUT]
    assert not missing, f"docs/layout.md's command table lacks {missing}"
