"""The compose stage's host-side variables never reach the stack: `docker compose` interpolates
the caller's environment into the compose files, so a name the files use, exported by
deploy/ci/compose-check.sh for its host-side tests, would rewire the stack it re-creates (the
gateway of the TLS re-create once dialled the scheduler at its host-published port, from inside
its container, and never became healthy)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_SCRIPT = ROOT / "deploy" / "ci" / "compose-check.sh"
_EXPORT = re.compile(r"^\s*export\s+(.*)$", re.MULTILINE)
_NAME = re.compile(r"\b([A-Z][A-Z0-9_]*)(?==|\s|$)")
_INTERPOLATED = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")


def _exported() -> set[str]:
    names: set[str] = set()
    for line in _EXPORT.findall(_SCRIPT.read_text()):
        names |= set(_NAME.findall(re.sub(r'"[^"]*"|\$\([^)]*\)', "", line)))
    return names


def _interpolated() -> set[str]:
    names: set[str] = set()
    for f in (ROOT / "deploy").glob("docker-compose*.yml"):
        names |= set(_INTERPOLATED.findall(f.read_text()))
    return names


def test_the_host_side_names_are_found() -> None:
    exported, used = _exported(), _interpolated()
    assert {"PDPLANE_STACK_GATEWAY", "PDPLANE_STACK_SCHEDULER"} <= exported, exported
    assert "PDPLANE_COMPOSE_SCHEDULER" in used, used


def test_no_variable_exported_for_the_host_tests_is_one_the_compose_files_read() -> None:
    # Those the script sets on purpose for the stack itself.
    meant = {"COMPOSE_FILE", "COMPOSE_PROJECT_NAME", "COMPOSE_ENV_FILES", "COMPOSE_PROFILES"}
    meant |= {n for n in _exported() if n.endswith("_PUBLISH_PORT")}
    meant |= {"PDPLANE_IMAGE_TAG", "PDPLANE_TLS_DIR", "PDPLANE_ENV_FILE"}
    meant |= {"PDPLANE_TORCH_INDEX_URL"}
    clash = (_exported() - meant) & _interpolated()
    assert not clash, f"compose-check.sh exports names the compose files interpolate: {clash}"
