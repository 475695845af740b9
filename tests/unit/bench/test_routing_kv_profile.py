"""kv_aware in a served routing run predicts the sims' time as the gateway's wall clock sees it:
sims at `--time-scale` S take 1/S wall seconds per modelled second."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing.routing import kv_profile_for
from pdplane.scheduler.latency import LatencyModel
from pdplane.sim.profiles import load_profile


def test_at_real_time_the_profile_is_named() -> None:
    assert kv_profile_for("llama3-8b-h100", 1.0, Path("/nonexistent")) == "llama3-8b-h100"


def test_at_a_fifth_of_real_time_every_prediction_is_five_times_longer(tmp_path: Path) -> None:
    path = kv_profile_for("llama3-8b-h100", 0.2, tmp_path)
    wall, modelled = LatencyModel(load_profile(path)), LatencyModel("llama3-8b-h100")
    for new, cached in ((100, 2000), (2000, 0), (8000, 0)):
        assert wall.idle_s(new, cached) == pytest.approx(5 * modelled.idle_s(new, cached))
        assert wall.queue_s(new, cached) == pytest.approx(5 * modelled.queue_s(new, cached))
    assert wall.transfer_ms(4000) == pytest.approx(5 * modelled.transfer_ms(4000))
    assert wall.step_ms(32, 40_000) == pytest.approx(5 * modelled.step_ms(32, 40_000))


def test_a_time_scale_of_zero_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        kv_profile_for("llama3-8b-h100", 0.0, tmp_path)
