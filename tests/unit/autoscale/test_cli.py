"""`pdplane autoscale`: what it says when it cannot run."""

from __future__ import annotations

import pytest

from pdplane.autoscale.__main__ import main as autoscale_main


def test_outside_a_pod_without_an_api_url_the_command_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    argv = [
        "--model",
        "m",
        "--prefill-workload",
        "deployment/p",
        "--decode-workload",
        "deployment/d",
    ]
    assert autoscale_main(argv) == 2
    err = capsys.readouterr().err
    assert "no in-cluster Kubernetes credentials" in err and "--kube-api" in err
