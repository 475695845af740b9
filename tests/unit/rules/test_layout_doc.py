"""docs/layout.md describes every source folder, every bench/ folder and every `pdplane`
command, and the trees keep their shape: adding a folder without a line there (a bench folder
also without its README.md), a benchmark script outside a subject folder, or a unit test outside
a folder named after what it tests fails here."""

from __future__ import annotations

from pathlib import Path

from pdplane.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = (ROOT / "docs" / "layout.md").read_text()
#: Folders of tests/unit/ that are not named after a source package: the project-wide rules.
UNIT_TEST_FOLDERS_BESIDE_THE_SOURCE = {"rules"}


def _source_folders(root: Path = ROOT) -> list[str]:
    folders = []
    for top in (root / "services" / "pdplane", root / "connector" / "pdplane"):
        for init in sorted(top.rglob("*.py")):
            folder = init.parent
            if "__pycache__" in folder.parts or folder.name == "v1":
                continue
            folders.append(f"{folder.relative_to(root).as_posix()}/")
    return sorted(set(folders))


def _undescribed(folders: list[str], layout: str) -> list[str]:
    return [f for f in folders if f"`{f}`" not in layout]


def _bench_problems(root: Path, layout: str) -> list[str]:
    """What bench/ lacks: a README.md or a docs/layout.md line per subject folder, and scripts
    in a subject folder (at bench/ top only the package and underscore helpers shared by
    several subjects)."""
    bench = root / "bench"
    problems = []
    for folder in sorted(p for p in bench.iterdir() if p.is_dir() and p.name != "__pycache__"):
        name = f"bench/{folder.name}/"
        if not (folder / "README.md").is_file():
            problems.append(f"{name} has no README.md")
        if f"`{name}`" not in layout:
            problems.append(f"docs/layout.md does not describe {name}")
    for path in sorted(p for p in bench.iterdir() if p.is_file()):
        if path.name != "__init__.py" and not path.name.startswith("_"):
            problems.append(f"bench/{path.name} is not in a subject folder")
    return problems


def _unit_test_problems(root: Path) -> list[str]:
    """Unit tests loose at tests/unit/, or in a folder named after nothing of the source: a
    `pdplane` package, a top-level folder (bench, deploy) or `rules`."""
    unit = root / "tests" / "unit"
    packages = {
        p.name for top in ("services", "connector") for p in (root / top / "pdplane").iterdir()
    }
    tops = {p.name for p in root.iterdir() if p.is_dir()}
    known = packages | tops | UNIT_TEST_FOLDERS_BESIDE_THE_SOURCE
    problems = [f"tests/unit/{p.name} is loose" for p in sorted(unit.glob("*.py"))]
    problems += [
        f"tests/unit/{p.name}/ is named after nothing of the source"
        for p in sorted(unit.iterdir())
        if p.is_dir() and p.name != "__pycache__" and p.name not in known
    ]
    return problems


def test_every_source_folder_is_described() -> None:
    missing = _undescribed(_source_folders(), LAYOUT)
    assert not missing, f"docs/layout.md does not describe {missing}"


def test_every_bench_folder_has_a_readme_and_a_layout_line() -> None:
    assert _bench_problems(ROOT, LAYOUT) == []
    assert "`tests/support/`" in LAYOUT


def test_unit_tests_sit_in_folders_named_after_the_source() -> None:
    assert _unit_test_problems(ROOT) == []


def test_every_command_is_listed() -> None:
    missing = [name for name in COMMANDS if f"| `pdplane {name}` |" not in LAYOUT]
    assert not missing, f"docs/layout.md's command table lacks {missing}"


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    # Guards the guard: a tree with each mistake once.
    for folder in ("services/pdplane/gateway", "connector/pdplane/connector", "deploy"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "services/pdplane/gateway/app.py").write_text("")
    for folder in ("bench/relay", "bench/newsubject", "tests/unit/gateway", "tests/unit/misc"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "bench/relay/README.md").write_text("")
    for name in ("__init__.py", "_procs.py", "loose.py"):
        (tmp_path / "bench" / name).write_text("")
    (tmp_path / "tests/unit/test_loose.py").write_text("")
    layout = "`bench/relay/` `services/pdplane/gateway/`"
    assert _undescribed(_source_folders(tmp_path), "") == ["services/pdplane/gateway/"]
    assert _undescribed(_source_folders(tmp_path), layout) == []
    assert _bench_problems(tmp_path, layout) == [
        "bench/newsubject/ has no README.md",
        "docs/layout.md does not describe bench/newsubject/",
        "bench/loose.py is not in a subject folder",
    ]
    assert _unit_test_problems(tmp_path) == [
        "tests/unit/test_loose.py is loose",
        "tests/unit/misc/ is named after nothing of the source",
    ]
