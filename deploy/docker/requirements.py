"""Prints pdplane's runtime requirements (plus the named extras) from pyproject.toml.

Image builds install dependencies in their own layer from this list, so that a source change
does not rebuild the (multi-gigabyte, for vLLM) dependency layer. Standard library only: it
runs in the bare base image.

Usage: python3 requirements.py PYPROJECT [EXTRA ...] > requirements.txt
Exits with status 2 when an extra is not defined in the file.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    """Returns the `[project]` dependencies followed by those of each extra, in file order.

    Raises KeyError naming the extra when `extras` holds one the file does not define.
    """
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise KeyError(extra)
        reqs.extend(optional[extra])
    return reqs


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write(__doc__ or "")
        return 2
    try:
        reqs = requirements(argv[0], argv[1:])
    except KeyError as exc:
        sys.stderr.write(f"error: extra {exc.args[0]!r} is not defined in {argv[0]}\n")
        return 2
    sys.stdout.write("".join(f"{r}\n" for r in reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
