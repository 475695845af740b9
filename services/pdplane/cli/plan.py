"""`pdplane plan` (`pdplane.plan.__main__`), with the local fleet's credentials.

Live advice (`--registry`) sends the local `pdplane up` fleet's shared token when it was given
none and the registry is that fleet's (`fleet_credentials.token_for`), like the other local
tools; the planner itself knows nothing of the command line's credentials file.
"""

from __future__ import annotations

from pdplane.cli import fleet_credentials
from pdplane.plan import __main__ as plan

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Runs `pdplane plan` (exit codes: `pdplane.plan.__main__`)."""
    return plan.main(argv, token_for=fleet_credentials.token_for)
