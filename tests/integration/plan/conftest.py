"""The gateway tests' stack (registry, scheduler, gateway, sims) for the live advice tests."""

from tests.integration.gateway.conftest import stack_factory

__all__ = ["stack_factory"]
