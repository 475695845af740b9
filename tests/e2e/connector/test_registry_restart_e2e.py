"""Registry restart with real vLLM CPU instances. Its own module, run after the others in this
folder: it briefly empties the registry the other tests read load reports from.
"""

from __future__ import annotations

import time

import pytest

from pdplane.launch.process import wait_until
from tests.e2e.conftest import RegistryHandle, VllmPair

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_registry_restart_relists_both_within_2s(
    vllm_pair: VllmPair, registry: RegistryHandle
) -> None:
    wanted = {vllm_pair.prefill_id, vllm_pair.decode_id}
    assert wanted <= {i.spec.instance_id for i in registry.list()}
    registry.restart()
    restarted = time.monotonic()
    wait_until(
        lambda: wanted <= {i.spec.instance_id for i in registry.list()},
        5.0,
        interval_s=0.05,
        what="both instances listed again",
    )
    relisted = time.monotonic() - restarted
    print(f"registry restart: both instances listed again after {relisted:.2f} s")
    assert relisted <= 2.0
