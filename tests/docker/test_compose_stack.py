"""Host-side checks of the docker compose deployment (`cpu` profile: registry, scheduler,
gateway, one prefill and one decode vLLM CPU instance), through the published ports only.

Run by `deploy/ci/compose-check.sh` after `docker compose --profile cpu up -d --build --wait`.
The registry-restart test runs last (file order): it disturbs the stack.
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdplane.cli import ls

pytestmark = pytest.mark.docker

#: DESIGN.md: a registry restart loses no instance for longer than ~2 s; the bar here is 5 s.
RELIST_DEADLINE_S = 5.0


def _ls_json(registry_addr: str, scheduler_addr: str = "") -> list[dict[str, Any]]:
    """`pdplane ls --registry ADDR --json`, in-process (the real command, no interpreter start);
    with `scheduler_addr`, each instance's `kv_index` as that scheduler's prefix index has it."""
    out = io.StringIO()
    argv = ["--registry", registry_addr, "--json", "--timeout-s", "1"]
    rc = ls.main([*argv, "--scheduler", scheduler_addr], out=out)
    if rc != 0:
        return []
    return list(json.loads(out.getvalue()))


def _roles(instances: list[dict[str, Any]]) -> list[str]:
    return sorted(i["role"] for i in instances)


def _completion(http: httpx.Client, model: str, prompt: str) -> httpx.Response:
    return http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )


def test_registry_answers_grpc_health_on_published_port(registry_addr: str) -> None:
    with grpc.insecure_channel(registry_addr) as chan:
        reply = health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_registry_refuses_a_wrong_token(
    registry_addr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Protected mode holds with the token the stack generated: no PDPLANE_INSECURE anywhere.
    argv = ["--registry", registry_addr, "--json", "--token", "wrong", "--scheduler", ""]
    assert ls.main(argv, out=io.StringIO()) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_pdplane_ls_lists_one_prefill_and_one_decode(registry_addr: str) -> None:
    instances = _ls_json(registry_addr)
    assert _roles(instances) == ["decode", "prefill"], instances
    by_role = {i["role"]: i for i in instances}
    # Instances advertise their compose service names: reachable from the other containers.
    assert by_role["prefill"]["url"] == "http://prefill:8100"
    assert by_role["decode"]["url"] == "http://decode:8100"
    assert by_role["prefill"]["kv_endpoint"] == "prefill:8200"
    assert {i["state"] for i in instances} == {"serving"}


def test_completion_through_gateway_returns_text(http: httpx.Client, model: str) -> None:
    resp = _completion(http, model, "the prefill cache block")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion"
    text = body["choices"][0]["text"]
    assert isinstance(text, str) and text, body
    assert body["usage"]["completion_tokens"] == 8


def test_streaming_chat_through_gateway_returns_text(http: httpx.Client, model: str) -> None:
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "decode the next token"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces: list[str] = []
    events: list[str] = []
    with http.stream("POST", "/v1/chat/completions", json=request) as resp:
        assert resp.status_code == 200, resp.read().decode()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data)
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            assert chunk["object"] == "chat.completion.chunk"
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "".join(pieces), events


def _prefix_cache_hits(docker: Any, service: str) -> float:
    """vLLM's `vllm:prefix_cache_hits_total` of the instance in `service` (its port is not
    published: read from inside its container)."""
    read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8100/metrics').read().decode())"
    text = docker("compose", "exec", "-T", service, "python3", "-c", read)
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:prefix_cache_hits_total"
    )


def test_a_shared_prefix_is_routed_as_a_predicted_hit_and_hits_vllms_cache(
    http: httpx.Client, model: str, docker: Any, registry_addr: str, scheduler_addr: str
) -> None:
    # The gateway has no tokenizer setting: it takes the one the connectors publish.
    deadline = time.monotonic() + 60
    entry: dict[str, Any] = {}
    while time.monotonic() < deadline and entry.get("routing") != "precise":
        entry = http.get("/health").json()["models"].get(model, {})
        time.sleep(0.2)
    assert entry.get("routing") == "precise", entry
    shared = " ".join(f"rule {i}: keep the answer short and exact." for i in range(24))
    route = {"X-Pdplane-Route": "1"}

    def ask(n: int) -> httpx.Response:
        body = {"model": model, "prompt": f"{shared} question {n}?", "max_tokens": 4}
        r = http.post("/v1/completions", json=body, headers=route)
        assert r.status_code == 200, r.text
        return r

    first = ask(1)
    prefill = first.headers["x-pdplane-prefill"].partition(";")[0]
    assert prefill and prefill != "none", first.headers
    # The scheduler's prefix index holds the prompt's blocks on the prefill before the next.
    deadline = time.monotonic() + 30
    index: Any = None
    while time.monotonic() < deadline:
        rows = {i["id"]: i for i in _ls_json(registry_addr, scheduler_addr)}
        index = rows.get(prefill, {}).get("kv_index")
        if isinstance(index, dict) and index["blocks"] >= 4 and index["lag_events"] == 0:
            break
        time.sleep(0.2)
    assert isinstance(index, dict) and index["blocks"] >= 4, index
    before = {side: _prefix_cache_hits(docker, side) for side in ("prefill", "decode")}
    second = ask(2)
    # The predicted hit is on prefill, or, when decode pulled the prefix with the first request
    # and computes the short rest itself (no prefill leg), on decode.
    prefill_id, _, prefill_cached = second.headers["x-pdplane-prefill"].partition(
        "; cached_tokens="
    )
    _, _, decode_cached = second.headers["x-pdplane-decode"].partition("; cached_tokens=")
    if prefill_id == "none":
        side, cached = "decode", int(decode_cached)
    else:
        assert prefill_id == prefill, second.headers
        side, cached = "prefill", int(prefill_cached)
    assert cached >= 4 * 128, second.headers  # the shared blocks, predicted
    assert _prefix_cache_hits(docker, side) - before[side] == cached, second.headers


@pytest.mark.parametrize("service", ["registry", "scheduler", "gateway", "prefill", "decode"])
def test_containers_run_as_non_root_without_build_tools(docker: Any, service: str) -> None:
    assert docker("compose", "exec", "-T", service, "id", "-u").strip() == "10001"
    found = docker(
        "compose", "exec", "-T", service, "sh", "-c", "command -v gcc cc c++ make ld || true"
    )
    assert found.strip() == "", f"build tools in the {service} image: {found}"


def test_registry_restart_relists_both_instances_within_5s(
    docker: Any, registry_addr: str, http: httpx.Client, model: str
) -> None:
    cid = docker("compose", "ps", "-q", "registry").strip()
    started_before = docker("inspect", "-f", "{{.State.StartedAt}}", cid).strip()

    docker("compose", "restart", "--timeout", "10", "registry")
    restarted = time.monotonic()
    assert docker("inspect", "-f", "{{.State.StartedAt}}", cid).strip() != started_before

    deadline = restarted + RELIST_DEADLINE_S
    instances: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        instances = _ls_json(registry_addr)
        if _roles(instances) == ["decode", "prefill"]:
            break
        time.sleep(0.1)
    relisted_s = time.monotonic() - restarted
    assert _roles(instances) == ["decode", "prefill"], f"after {relisted_s:.1f} s: {instances}"

    # The scheduler re-watches the restarted registry: requests succeed again, same deadline.
    resp = _completion(http, model, f"after the restart {relisted_s:.3f}")
    while resp.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        resp = _completion(http, model, f"after the restart {time.monotonic()}")
    served_s = time.monotonic() - restarted
    print(f"registry restart: relisted in {relisted_s:.2f} s, serving in {served_s:.2f} s")
    assert resp.status_code == 200, f"after {served_s:.1f} s: {resp.text}"
    # Every request above was sent before the deadline; the last one succeeded.
    assert resp.json()["choices"][0]["text"]
