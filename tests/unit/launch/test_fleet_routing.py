"""`Fleet`'s wait for precise routing, against a stand-in gateway /health: bounded while the
gateway is still fetching the tokenizer (then "pending": by load until it arrives), over at
once when the instances publish none."""

from __future__ import annotations

import http.server
import json
import time
from typing import Any, ClassVar

import pytest

from pdplane.launch.deployment import Fleet, FleetSpec
from tests.loopback_http import serving


class _Health(http.server.BaseHTTPRequestHandler):
    entry: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok", "models": {"m": self.entry}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def _fleet(url: str) -> Fleet:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    fleet = Fleet(FleetSpec(host=host, gateway_port=int(port)))
    fleet.model_name = "m"
    return fleet


@pytest.mark.parametrize(
    ("entry", "routing"),
    [
        (
            {"routing": "precise", "routing_reason": "published", "tokenizer": "sha256:ab"},
            "precise",
        ),
        ({"routing": "load", "routing_reason": "no instance publishes", "tokenizer": ""}, "load"),
    ],
)
def test_a_settled_state_ends_the_wait_at_once(entry: dict[str, Any], routing: str) -> None:
    _Health.entry = entry
    with serving(_Health) as url:
        fleet = _fleet(url)
        started = time.monotonic()
        fleet._wait_routing(timeout_s=60.0)
    assert (fleet.routing, fleet.routing_reason) == (routing, entry["routing_reason"])
    assert time.monotonic() - started < 60.0


def test_a_tokenizer_still_fetching_is_waited_for_a_bounded_time() -> None:
    _Health.entry = {"routing": "load", "routing_reason": "fetching x", "tokenizer": "sha256:ab"}
    with serving(_Health) as url:
        fleet = _fleet(url)
        fleet._wait_routing(timeout_s=0.5)  # returns, no TimeoutError
    assert (fleet.routing, fleet.routing_reason) == ("pending", "fetching x")
