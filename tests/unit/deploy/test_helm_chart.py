"""deploy/helm/pdplane without a cluster: `helm lint --strict` and `helm template` of every preset
(and of variants that switch on what the presets leave off), every rendered object against
Kubernetes' own OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), and the
wiring: every address, port, token, TLS path, flag and `$(VAR)` a pod uses exists in the
rendered objects or is a real pdplane flag."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from pdplane.autoscale.__main__ import AutoscaleSettings
from pdplane.connector.config import ConnectorConfig
from pdplane.core.settings import CommandSettings
from pdplane.gateway.settings import GatewaySettings
from pdplane.registry.relay import RelaySettings
from pdplane.registry.settings import RegistrySettings
from pdplane.scheduler.settings import SchedulerSettings
from tests.unit.deploy.helm_chart import (
    CHART_DIR,
    NAMESPACE,
    PRESETS,
    RELEASE,
    Container,
    Rendered,
    lint,
    preset,
    render,
)

# The chart's kubeVersion floor (native gRPC probes are GA in 1.27) and the newest schemas.
KUBE_VERSIONS = ("1.27", kubernetes_validate.latest_version())

TLS = {"tls": {"enabled": True, "existingSecret": "pd-tls"}}
VARIANTS: dict[str, list[dict[str, Any]]] = {
    **{name: [preset(name)] for name in PRESETS},
    "cpu-demo+tls+monitor+keys": [
        preset("cpu-demo"),
        TLS,
        {"serviceMonitor": {"enabled": True}, "auth": {"apiKeys": ["k1", "k2"]}},
    ],
    "cpu-demo+embedded": [
        preset("cpu-demo"),
        {"scheduler": {"mode": "embedded"}, "gateway": {"replicas": 2}},
    ],
    "gpu-xpyd+statefulset+tls+monitor": [
        preset("gpu-xpyd"),
        TLS,
        {"engineDefaults": {"workload": "StatefulSet"}, "serviceMonitor": {"enabled": True}},
    ],
    "cpu-demo+autoscaler": [preset("cpu-demo"), {"autoscaler": {"enabled": True}}],
    "gpu-xpyd+registry-relay+tls": [preset("gpu-xpyd"), TLS, {"registryRelay": {"enabled": True}}],
    "gpu-xpyd+autoscaler+statefulset+tls": [
        preset("gpu-xpyd"),
        TLS,
        {
            "autoscaler": {"enabled": True, "replicas": 2, "gpus": 16},
            "engineDefaults": {"workload": "StatefulSet"},
        },
    ],
    "gpu-1p1d+external-etcd+secret+push": [
        preset("gpu-1p1d"),
        {
            "registry": {"store": "etcd", "replicas": 3},
            "etcd": {
                "enabled": False,
                "endpoints": ["etcd-a.infra:2379", "etcd-b.infra:2379"],
                "clientTls": {"existingSecret": "etcd-client"},
            },
            "auth": {"existingSecret": "pd-auth"},
            "engineDefaults": {"kvMode": "push", "connectorExtra": {"transfer_timeout_s": 30}},
        },
    ],
}
# Secrets the variants name but do not create (the operator does), with the keys the chart
# documents for them.
EXTERNAL_SECRETS = {
    "pd-tls": {"tls.crt", "tls.key", "ca.crt"},
    "etcd-client": {"tls.crt", "tls.key", "ca.crt"},
    "pd-auth": {"token", "api-keys"},
}
# Addresses outside the release that the variants configure (an external etcd).
EXTERNAL_ADDRESSES = {"etcd-a.infra:2379", "etcd-b.infra:2379"}
PDPLANE_COMMANDS: dict[str, type[CommandSettings]] = {
    "registry": RegistrySettings,
    "registry-relay": RelaySettings,
    "scheduler": SchedulerSettings,
    "gateway": GatewaySettings,
    "autoscale": AutoscaleSettings,
}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(render(*VARIANTS[request.param]))


# --- lint and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_helm_lint_strict_passes_every_preset(name: str) -> None:
    findings = [m for m in lint(preset(name)) if m["severity"] >= 2]
    assert findings == []


def test_presets_cover_cpu_demo_1p1d_and_xpyd() -> None:
    assert {"cpu-demo", "gpu-1p1d", "gpu-xpyd"} <= set(PRESETS)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_validates_against_kubernetes_schemas(
    rendered: Rendered, version: str
) -> None:
    for obj in rendered.objects:
        if obj["kind"] == "ServiceMonitor":
            continue  # a CRD: checked by its own schema below
        kubernetes_validate.validate(obj, version, strict=True)


# The fields of monitoring.coreos.com/v1 ServiceMonitor the chart uses (Prometheus Operator's
# CRD is not part of Kubernetes' schemas).
_SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "matchExpressions": {"type": "array"},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def test_service_monitors_select_services_with_their_port(rendered: Rendered) -> None:
    for monitor in rendered.of("ServiceMonitor"):
        jsonschema.validate(monitor, _SERVICE_MONITOR)
        selector = monitor["spec"]["selector"]
        services = [
            s
            for s in rendered.of("Service")
            if selector.get("matchLabels", {}).items() <= s["metadata"]["labels"].items()
            and all(
                e["key"] in s["metadata"]["labels"] for e in selector.get("matchExpressions", [])
            )
        ]
        assert services, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["endpoints"]:
            for svc in services:
                assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


# --- wiring --------------------------------------------------------------------------------


def _service_port(rendered: Rendered, address: str, where: str) -> None:
    """`address` (host:port) names a rendered Service port whose pods listen on it."""
    host, _, port = address.rpartition(":")
    labels = host.split(".")
    if len(labels) > 1 and labels[1] in rendered.names("Service"):
        # <pod>.<headless service>.<namespace>.svc...: one StatefulSet pod by its stable name.
        pod, svc_name = labels[0], labels[1]
        assert labels[2] == NAMESPACE, (where, address)
        owners = [w for w in rendered.of("StatefulSet") if w["spec"]["serviceName"] == svc_name]
        assert len(owners) == 1, (where, address)
        ordinal = pod.removeprefix(owners[0]["metadata"]["name"] + "-")
        assert ordinal.isdigit() and int(ordinal) < owners[0]["spec"]["replicas"], (where, pod)
    else:
        svc_name = labels[0]
    assert svc_name in rendered.names("Service"), (where, address)
    svc = rendered.one("Service", svc_name)
    ports = {p["port"]: p for p in svc["spec"]["ports"]}
    assert int(port) in ports, (where, address, sorted(ports))
    target = ports[int(port)].get("targetPort", int(port))
    backends = rendered.selected(svc["spec"]["selector"])
    assert backends, (where, f"Service {svc_name} selects no pod")
    for w in backends:
        listening = [
            p
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports") or []
            if p.get("name") == target or p["containerPort"] == target
        ]
        assert listening, (where, address, w["metadata"]["name"])


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _addresses(c: Container) -> list[str]:
    """Every registry/scheduler/etcd address the container is given."""
    args = c.args()
    out = [
        v
        for f in ("--registry", "--scheduler", "--peers")
        if (v := _flag(args, f)) not in (None, "embedded")
    ]
    out += (_flag(args, "--etcd-endpoints") or "").split(",")
    if "PDPLANE_REGISTRY" in c.env():
        out.append(c.env()["PDPLANE_REGISTRY"]["value"])
    if (config := _kv_transfer_config(c)) is not None:
        out.append(config["kv_connector_extra_config"]["registry"])
    return [a.removeprefix("dns:///") for a in out if a]


def _kv_transfer_config(c: Container) -> dict[str, Any] | None:
    raw = _flag(c.args(), "--kv-transfer-config")
    return None if raw is None else json.loads(raw)


def test_every_address_a_pod_dials_is_a_rendered_service_port(rendered: Rendered) -> None:
    for c in rendered.containers():
        for address in set(_addresses(c)) - EXTERNAL_ADDRESSES:
            _service_port(rendered, address, c.where)


def test_every_var_reference_is_defined_before_use(rendered: Rendered) -> None:
    for c in rendered.containers():
        defined: set[str] = set()
        for e in c.spec.get("env") or []:
            assert set(_VAR.findall(str(e.get("value", "")))) <= defined, (c.where, e["name"])
            defined.add(e["name"])
        for text in [*(c.spec.get("command") or []), *c.args()]:
            assert set(_VAR.findall(str(text))) <= defined, (c.where, text)


def _secret_keys(rendered: Rendered, name: str) -> set[str]:
    if name in rendered.names("Secret"):
        return set(rendered.one("Secret", name).get("data") or {})
    assert name in EXTERNAL_SECRETS, f"Secret {name} neither rendered nor configured"
    return EXTERNAL_SECRETS[name]


def test_every_secret_and_config_map_reference_exists(rendered: Rendered) -> None:
    for c in rendered.containers():
        for e in c.spec.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                assert ref["key"] in _secret_keys(rendered, ref["name"]), (c.where, e["name"])
        assert len(c.mounts()) == len(c.spec.get("volumeMounts") or []), c.where  # all found
    for w in rendered.workloads():
        for v in w["spec"]["template"]["spec"].get("volumes") or []:
            if "configMap" in v:
                cm = rendered.one("ConfigMap", v["configMap"]["name"])
                assert cm["data"], v
            if "secret" in v:
                _secret_keys(rendered, v["secret"]["secretName"])


def _tls_paths(c: Container) -> list[str]:
    env = c.env()
    paths = [
        env[n]["value"]
        for n in ("PDPLANE_TLS_CA", "PDPLANE_TLS_CERT", "PDPLANE_TLS_KEY")
        if n in env
    ]
    paths += [v for f in ("--etcd-ca", "--etcd-cert", "--etcd-key") if (v := _flag(c.args(), f))]
    if (config := _kv_transfer_config(c)) is not None:
        extra = config["kv_connector_extra_config"]
        paths += [
            extra[k] for k in ("tls_ca", "tls_cert", "tls_key", "registry_tls_ca") if k in extra
        ]
    probe = (c.spec.get("readinessProbe") or {}).get("exec", {}).get("command", [])
    paths += [v for v in [_flag(probe, "--tls-ca")] if v]
    return paths


def test_every_tls_path_is_a_key_of_a_mounted_secret(rendered: Rendered) -> None:
    for c in rendered.containers():
        mounts = c.mounts()
        used = set()
        for path in _tls_paths(c):
            folder, _, key = path.rpartition("/")
            assert folder in mounts and "secret" in mounts[folder], (c.where, path)
            secret = mounts[folder]["secret"]["secretName"]
            assert key in _secret_keys(rendered, secret), (c.where, path)
            used.add(folder)
        # ...and every certificate Secret a container mounts is used by it.
        certs = {
            p
            for p, v in mounts.items()
            if v.get("secret", {}).get("secretName") in EXTERNAL_SECRETS
        }
        assert certs <= used, (c.where, certs - used)


def _is_pdplane_service(c: Container) -> bool:
    return bool(c.args()) and c.args()[0] in PDPLANE_COMMANDS


def _is_engine(c: Container) -> bool:
    return not c.init and c.labels.get("app.kubernetes.io/component", "").startswith("engine-")


def test_every_grpc_caller_sends_the_shared_token(rendered: Rendered) -> None:
    engines = 0
    for c in rendered.containers():
        if not (_is_pdplane_service(c) or _is_engine(c)):
            continue
        token = c.env().get("PDPLANE_TOKEN")
        assert token and token["valueFrom"]["secretKeyRef"]["key"], c.where
        if _kv_transfer_config(c) is not None:
            # vLLM's own connector reads its registry credential from the environment.
            assert c.env()["PDPLANE_REGISTRY_TOKEN"]["value"] == "$(PDPLANE_TOKEN)", c.where
        engines += _is_engine(c)
    groups = [
        w
        for w in rendered.workloads()
        if w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"].startswith(
            "engine-"
        )
    ]
    assert engines == len(groups) > 0


def test_no_token_appears_in_any_containers_args_or_command(rendered: Rendered) -> None:
    # argv is readable by every process of the node (`ps`, /proc/*/cmdline): tokens travel in
    # the environment only, neither as a $(VAR) reference nor as the Secret's value.
    secrets = {
        base64.b64decode(v).decode()
        for s in rendered.of("Secret")
        for v in (s.get("data") or {}).values()
    }
    for c in rendered.containers():
        argv = [str(a) for a in [*(c.spec.get("command") or []), *c.args()]]
        for text in argv:
            assert "TOKEN)" not in text, (c.where, text)
            assert not any(len(v) >= 16 and v in text for v in secrets), c.where
        if (config := _kv_transfer_config(c)) is not None:
            extra = config["kv_connector_extra_config"]
            assert not {"token", "registry_token"} & set(extra), c.where


def test_probes_and_services_use_ports_their_containers_have(rendered: Rendered) -> None:
    for c in rendered.containers():
        if c.init:
            continue
        named = c.port_numbers()
        numbers = set(named.values())
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.spec.get(kind)
            if not probe:
                continue
            port = (probe.get("httpGet") or probe.get("grpc") or {}).get("port")
            if port is not None:
                assert port in named or port in numbers, (c.where, kind, port)
            if "grpc" in probe:
                assert str(probe["grpc"]["port"]) == _flag(c.args(), "--port"), c.where
    for svc in rendered.of("Service"):
        backends = rendered.selected(svc["spec"]["selector"])
        assert backends, svc["metadata"]["name"]
        for p in svc["spec"]["ports"]:
            for w in backends:
                names = {
                    q.get("name")
                    for ct in w["spec"]["template"]["spec"]["containers"]
                    for q in ct.get("ports") or []
                }
                assert p["targetPort"] in names, (svc["metadata"]["name"], p)
    for pdb in rendered.of("PodDisruptionBudget"):
        assert rendered.selected(pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]["name"]


def _literal_env(c: Container) -> dict[str, str]:
    """The container's env as the process sees it, secrets and $(VAR)s as placeholders."""
    out: dict[str, str] = {}
    for name, e in c.env().items():
        out[name] = _VAR.sub("x", str(e["value"])) if "value" in e else "placeholder"
    return out


def test_every_pdplane_flag_the_chart_passes_exists(
    rendered: Rendered, monkeypatch: pytest.MonkeyPatch, vllm_instance: Any
) -> None:
    """The pdplane containers' arguments parse with the commands' own settings classes (an
    unknown or misspelled flag exits 2), and the connector's extra config with its own model."""
    for c in rendered.containers():
        with monkeypatch.context() as env:
            for k, v in _literal_env(c).items():
                if k.startswith("PDPLANE_"):
                    env.setenv(k, v)
            args = [_VAR.sub("x", a) for a in c.args()]
            if _is_pdplane_service(c):
                command, flags = args[0], args[1:]
                if "--store" in flags and "store" not in RegistrySettings.model_fields:
                    # The etcd store's flags come with it; until then check the rest.
                    RegistrySettings.parse(flags[: flags.index("--store")])
                else:
                    PDPLANE_COMMANDS[command].parse(flags)
            elif _is_engine(c) and (config := _kv_transfer_config(c)) is not None:
                extra = json.loads(_VAR.sub("x", json.dumps(config["kv_connector_extra_config"])))
                ConnectorConfig.from_extra_config(extra)
                assert config["kv_role"] in ("kv_producer", "kv_consumer", "kv_both")
            elif _is_engine(c):
                vllm_instance.InstanceSettings.parse(args, prog="pdplane-vllm-cpu")


def test_engines_register_under_their_pod_name_and_drain_on_scale_in(rendered: Rendered) -> None:
    for c in rendered.containers():
        if not _is_engine(c):
            continue
        env = c.env()
        assert env["PDPLANE_INSTANCE_ID"]["value"] == "$(POD_NAME)"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        pre_stop = c.spec["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[-1] in c.mounts() or pre_stop[-1].rpartition("/")[0] in c.mounts()
        grace = c.pod["terminationGracePeriodSeconds"]
        assert grace > int(env["PDPLANE_DRAIN_TIMEOUT_S"]["value"]), c.where
        if (config := _kv_transfer_config(c)) is not None:
            assert config["kv_connector_extra_config"]["instance_id"] == "$(POD_NAME)"


def test_with_the_registry_relay_engines_heartbeat_through_their_node_s_relay() -> None:
    r = Rendered(render(preset("gpu-xpyd"), {"registryRelay": {"enabled": True}}))
    relay = "pd-pdplane-registry-relay"
    service = r.one("Service", relay)
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    (container,) = [c for c in r.containers() if c.workload["metadata"]["name"] == relay]
    assert container.workload["kind"] == "DaemonSet"
    assert _flag(container.args(), "--registry") == "pd-pdplane-registry:8051"
    engines = [c for c in r.containers() if _is_engine(c)]
    assert engines
    for c in engines:
        assert c.env()["PDPLANE_REGISTRY"]["value"] == f"{relay}:8054", c.where
        if (config := _kv_transfer_config(c)) is not None:
            assert config["kv_connector_extra_config"]["registry"] == f"{relay}:8054"
    # The control plane still reads the registry itself.
    for c in r.containers():
        if _is_pdplane_service(c) and c.args()[0] in ("scheduler", "gateway"):
            assert _flag(c.args(), "--registry") == "pd-pdplane-registry:8051", c.where
    # Off by default: no relay, engines dial the registry.
    plain = Rendered(render(preset("gpu-xpyd")))
    assert relay not in plain.names("DaemonSet")
    assert all(
        c.env()["PDPLANE_REGISTRY"]["value"] == "pd-pdplane-registry:8051"
        for c in plain.containers()
        if _is_engine(c)
    )


def test_gpu_engines_request_their_gpus_and_nccl_settings() -> None:
    r = Rendered(render(preset("gpu-xpyd")))
    engines = [c for c in r.containers() if _is_engine(c)]
    assert {c.workload["metadata"]["name"]: c.workload["spec"]["replicas"] for c in engines} == {
        f"{RELEASE}-pdplane-prefill": 2,
        f"{RELEASE}-pdplane-decode": 4,
    }
    for c in engines:
        assert c.spec["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert _flag(c.args(), "--tensor-parallel-size") == "2"
        assert c.env()["NCCL_NVLS_ENABLE"]["value"] == "0"
        assert {"kv", "kv-1"} <= set(c.port_numbers())  # rank i on kvPort + i
        assert json.loads(_flag(c.args(), "--kv-events-config") or "{}")["enable_kv_cache_events"]
        assert c.mounts()["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_etcd_backed_registry_runs_replicas_over_the_in_chart_members() -> None:
    r = Rendered(render(preset("gpu-xpyd")))
    registry = r.one("Deployment", f"{RELEASE}-pdplane-registry")
    args = registry["spec"]["template"]["spec"]["containers"][0]["args"]
    assert registry["spec"]["replicas"] == 2
    assert _flag(args, "--store") == "etcd" and _flag(args, "--etcd-prefix") == "/pdplane/"
    members = (_flag(args, "--etcd-endpoints") or "").split(",")
    assert len(members) == r.one("StatefulSet", f"{RELEASE}-pdplane-etcd")["spec"]["replicas"] == 3
    assert r.names("PodDisruptionBudget") >= {
        f"{RELEASE}-pdplane-{n}" for n in ("etcd", "registry")
    }


def test_embedded_mode_has_no_scheduler_and_gateways_share_in_flight_state() -> None:
    r = Rendered(render(*VARIANTS["cpu-demo+embedded"]))
    assert f"{RELEASE}-pdplane-scheduler" not in r.names("Deployment")
    gateway = r.one("Deployment", f"{RELEASE}-pdplane-gateway")
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(args, "--scheduler") == "embedded"
    assert _flag(args, "--decode-policy") == "kv_aware"
    assert _flag(args, "--kv-profile") == "llama3-8b-h100"  # what kv_aware predicts with
    # Each gateway follows the others through a headless Service of every gateway pod.
    assert _flag(args, "--peers") == f"{RELEASE}-pdplane-gateway-peers:8053"
    assert _flag(args, "--replica-id") == "$(POD_NAME)"
    peers = r.one("Service", f"{RELEASE}-pdplane-gateway-peers")
    assert peers["spec"]["clusterIP"] == "None"


def test_scheduler_replicas_follow_each_other() -> None:
    r = Rendered(render(preset("gpu-xpyd")))
    scheduler = r.one("Deployment", f"{RELEASE}-pdplane-scheduler")
    args = scheduler["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(args, "--peers") == f"{RELEASE}-pdplane-scheduler-peers:8052"
    assert _flag(args, "--kv-profile") == "llama3-8b-h100"
    assert r.one("Service", f"{RELEASE}-pdplane-scheduler-peers")["spec"]["clusterIP"] == "None"
    # ...and the gateways reach all of them by it (failover without waiting for kube-proxy).
    gateway = r.one("Deployment", f"{RELEASE}-pdplane-gateway")
    target = _flag(gateway["spec"]["template"]["spec"]["containers"][0]["args"], "--scheduler")
    assert target == f"dns:///{RELEASE}-pdplane-scheduler-peers:8052"
    single = Rendered(render(preset("cpu-demo")))
    one = single.one("Deployment", f"{RELEASE}-pdplane-scheduler")
    assert "--peers" not in one["spec"]["template"]["spec"]["containers"][0]["args"]


def test_tls_switches_grpc_probes_to_exec_with_the_ca() -> None:
    plain = Rendered(render(preset("cpu-demo")))
    tls = Rendered(render(preset("cpu-demo"), TLS))
    name = f"{RELEASE}-pdplane-registry"
    probe = plain.one("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
    assert probe["readinessProbe"]["grpc"] == {"port": 8051}
    probe = tls.one("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
    command = probe["readinessProbe"]["exec"]["command"]
    assert command[:3] == ["pdplane-healthcheck", "grpc", "127.0.0.1:8051"]
    assert _flag(command, "--tls-server-name") == name


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"registry": {"replicas": 2}}, "needs registry.store=etcd"),
        ({"registry": {"store": "etcd"}, "etcd": {"enabled": False}}, "etcd.endpoints"),
        ({"tls": {"enabled": True}}, "tls.existingSecret"),
        # values.schema.json catches this one before the templates run.
        ({"engines": [{"name": "x", "role": "router"}]}, "/engines/0/role': value must be one of"),
        ({"engineDefaults": {"tensorParallelSize": 2}}, "gpus (1) < tensorParallelSize (2)"),
    ],
)
def test_bad_values_fail_the_render_with_a_clear_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(preset("gpu-1p1d"), values)


def test_the_admin_token_reaches_only_the_registry_and_the_engines_drain(
    rendered: Rendered,
) -> None:
    # The registry checks it; an engine pod's preStop `pdplane drain` sends it; the scheduler
    # and the gateway never change another instance's lease, so they do not get it.
    seen: set[str] = set()
    for c in rendered.containers():
        admin = c.env().get("PDPLANE_ADMIN_TOKEN")
        if _is_engine(c) or (_is_pdplane_service(c) and c.args()[0] == "registry"):
            assert admin and admin["valueFrom"]["secretKeyRef"]["key"], c.where
            seen.add("engine" if _is_engine(c) else "registry")
        else:
            assert admin is None, c.where
    assert seen == {"engine", "registry"}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_gateway_needs_no_tokenizer_value(name: str) -> None:
    # Each model's tokenizer comes from its instances: no chart value, flag or env names one,
    # and the fetched files go to a writable volume (the root file system is read-only).
    r = Rendered(render(*VARIANTS[name]))
    gateways = [c for c in r.containers() if c.spec["name"] == "gateway"]
    assert gateways, name
    for c in gateways:
        assert "--tokenizer" not in c.args() and "PDPLANE_TOKENIZER" not in c.env(), c.where
        cache = c.env()["PDPLANE_TOKENIZER_CACHE_DIR"]["value"]
        mounted = [path for path in c.mounts() if cache.startswith(path + "/")]
        assert mounted and "emptyDir" in c.mounts()[mounted[0]], c.where
        assert c.spec["securityContext"]["readOnlyRootFilesystem"] is True
    for values in (CHART_DIR / "values.yaml", *sorted((CHART_DIR / "presets").glob("*.yaml"))):
        assert "tokenizer" not in values.read_text().lower(), values


def test_gateway_readiness_probes_the_gateway_s_own_health_or_one_model_s() -> None:
    # /health stays 200 while any model has a pair (one model's trouble must not take the
    # others' traffic away); /health?model=NAME is one model's readiness.
    name = f"{RELEASE}-pdplane-gateway"

    def probe_path(*values: dict[str, Any]) -> str:
        pod = Rendered(render(*values)).one("Deployment", name)["spec"]["template"]["spec"]
        return str(pod["containers"][0]["readinessProbe"]["httpGet"]["path"])

    assert probe_path(preset("cpu-demo")) == "/health"
    one = {"gateway": {"readinessModel": "llama 3/8b"}}
    assert probe_path(preset("cpu-demo"), one) == "/health?model=llama+3%2F8b"


def test_the_tenants_secret_is_mounted_as_a_directory_and_passed_to_the_gateway() -> None:
    # A directory mount (no subPath): the kubelet's updates of the Secret reach the file, which
    # the gateway rereads without a restart.
    r = Rendered(render(preset("cpu-demo"), {"gateway": {"tenantsSecret": "my-tenants"}}))
    (gateway,) = [c for c in r.containers() if c.spec["name"] == "gateway"]
    args = gateway.args()
    path = args[args.index("--tenants") + 1]
    mounts = gateway.mounts()
    (directory,) = [m for m in mounts if path.startswith(m + "/")]
    assert mounts[directory]["secret"]["secretName"] == "my-tenants"
    assert not any("subPath" in m for m in gateway.spec["volumeMounts"])
    plain = Rendered(render(preset("cpu-demo")))
    (gateway,) = [c for c in plain.containers() if c.spec["name"] == "gateway"]
    assert "--tenants" not in gateway.args()
