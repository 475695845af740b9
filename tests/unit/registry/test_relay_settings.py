"""`pdplane registry-relay`'s flags: bad values are refused with one line and exit 2."""

from __future__ import annotations

import pytest

from pdplane.registry.relay import RelaySettings


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--registry", "127.0.0.1"], "'127.0.0.1' is not host:port"),
        (["--registry", "127.0.0.1:99999"], "'127.0.0.1:99999' is not host:port"),
        (["--registry", "a:1,,b:2"], "'' is not host:port"),
        (["--registry", "127.0.0.1:18054", "--port", "18054"], "is this relay itself"),
        (["--registry", "localhost:8054"], "is this relay itself (--port 8054)"),
        (["--flush-interval-ms", "2000", "--stale-after-ms", "1000"], "longer than"),
        (["--log-level", "bogus"], "unknown logging level 'bogus'"),
        (["--host", "0.0.0.0"], "refusing to listen on 0.0.0.0 without a token"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        RelaySettings.parse(flags, prog="pdplane registry-relay")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pdplane registry-relay: ") and says in err, err
    assert len(err.strip().splitlines()) == 1


def test_several_replicas_and_grpc_targets_are_accepted() -> None:
    s = RelaySettings.parse(["--registry", "r1:8051, [::1]:8051,dns:///registry.svc:8051"])
    assert s.registry.startswith("r1:8051")
