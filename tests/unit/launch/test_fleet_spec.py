"""`pdplane up` settings -> FleetSpec: what every vLLM instance of the fleet is started with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdplane.cli.up import UpSettings
from pdplane.gateway.settings import GatewaySettings
from pdplane.launch.deployment import Fleet, FleetSpec, PortsInUse
from pdplane.launch.sim_process import SimOptions, SimProcess
from pdplane.scheduler.settings import SchedulerSettings


def test_defaults_pull_and_split_vllm_args() -> None:
    spec = FleetSpec.from_settings(UpSettings.parse(["--vllm-args", "--seed 7 --max-num-seqs 8"]))
    assert (spec.prefill, spec.decode, spec.gateway_port) == (1, 1, 8000)
    assert spec.vllm_args == ["--seed", "7", "--max-num-seqs", "8"]
    assert spec.vllm_options == {}  # pull: the connector's default mode


def test_push_mode_reaches_every_connector_and_xpyd_counts() -> None:
    settings = UpSettings.parse(
        ["--kv-mode", "push", "--prefill", "2", "--decode", "3", "--model", "/m"]
    )
    spec = FleetSpec.from_settings(settings)
    assert spec.vllm_options == {"connector_extra": {"mode": "push"}}
    assert (spec.prefill, spec.decode, spec.model) == (2, 3, Path("/m"))


def test_store_etcd_reaches_the_spec() -> None:
    spec = FleetSpec.from_settings(UpSettings.parse(["--store", "etcd", "--etcd-port", "23790"]))
    assert (spec.store, spec.etcd_port) == ("etcd", 23790)
    assert FleetSpec.from_settings(UpSettings.parse([])).store == "memory"


def test_queue_timeout_reaches_the_gateway_spec() -> None:
    spec = FleetSpec.from_settings(UpSettings.parse(["--queue-timeout-s", "5"]))
    assert spec.queue_timeout_s == 5.0
    assert FleetSpec.from_settings(UpSettings.parse([])).queue_timeout_s == 60.0
    assert FleetSpec().queue_timeout_s is None  # the gateway's default or its env


def test_kv_profile_reaches_the_scheduler_spec() -> None:
    # up serves the tiny model on vLLM CPU unless told otherwise: kv_aware predicts with its fit
    assert FleetSpec.from_settings(UpSettings.parse([])).kv_profile == "tiny-cpu"
    spec = FleetSpec.from_settings(UpSettings.parse(["--kv-profile", "qwen2-7b-a100"]))
    assert spec.kv_profile == "qwen2-7b-a100"
    assert FleetSpec().kv_profile is None  # the scheduler's default or its env


def test_an_unknown_kv_profile_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        UpSettings.parse(["--kv-profile", "no-such-profile"])
    assert exited.value.code == 2
    assert "--kv-profile" in capsys.readouterr().err


_GATEWAY_FLAGS = (
    ("--inflight-budget", "0.5"),
    ("--flow-policy", "fifo"),
    ("--max-queued-requests", "7"),
    ("--migration-limit", "5"),
    ("--migration-timeout-s", "20.0"),
    ("--drain-grace-s", "2.5"),
)


def test_flow_control_and_migration_flags_reach_the_gateway_with_the_gateway_s_defaults() -> None:
    spec = FleetSpec.from_settings(UpSettings.parse([a for pair in _GATEWAY_FLAGS for a in pair]))
    flags = spec.gateway_flags()
    for flag, value in _GATEWAY_FLAGS:
        assert flags[flags.index(flag) + 1] == value
    gateway = GatewaySettings.parse([])
    defaults = UpSettings.parse([])
    names = [flag.removeprefix("--").replace("-", "_") for flag, _ in _GATEWAY_FLAGS]
    for name in [*names, "api_key"]:
        assert getattr(defaults, name) == getattr(gateway, name), name
    assert FleetSpec().gateway_flags() == []  # the gateway's own defaults or its env


def test_the_api_key_goes_to_the_gateway_s_environment_only() -> None:
    spec = FleetSpec.from_settings(UpSettings.parse(["--api-key", "sk-a, sk-b"]))
    assert "sk-a" not in " ".join(spec.gateway_flags())
    fleet = Fleet(spec)
    assert fleet._env(gateway=True)["PDPLANE_API_KEY"] == "sk-a, sk-b"
    assert "PDPLANE_API_KEY" not in fleet._env()


def test_the_demo_key_is_the_first_api_key_else_the_tenants_file_s_first(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('keys = [{key = "sk-t1", tenant = "a"}, {key = "sk-t2", tenant = "b"}]\n')
    assert FleetSpec(api_key=" sk-a, sk-b", tenants=tenants).client_key() == "sk-a"
    assert FleetSpec(tenants=tenants).client_key() == "sk-t1"
    assert FleetSpec().client_key() is None


def test_a_bad_tenants_file_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text("keys: [{key: sk-x}]")  # no tenant
    with pytest.raises(SystemExit) as exited:
        UpSettings.parse(["--tenants", str(bad)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--tenants" in err and str(bad) in err


def test_the_port_check_covers_every_port_flag_of_up() -> None:
    settings = UpSettings.parse(["--store", "etcd", "--engine", "sim", "--autoscale"])  # all
    checked = {flag for _, _, flag in Fleet(FleetSpec.from_settings(settings)).wanted_ports()}
    port_flags = {
        "--" + name.replace("_", "-") for name in UpSettings.model_fields if name.endswith("_port")
    }
    assert checked == port_flags


def test_the_autoscale_metrics_port_is_bound_only_with_a_controller() -> None:
    plain = Fleet(FleetSpec.from_settings(UpSettings.parse([])))
    assert plain.spec.autoscale_metrics_port == 0
    assert plain.autoscale_metrics_url == "off"
    assert "autoscale metrics" not in [what for _, what, _ in plain.wanted_ports()]
    args = ["--engine", "sim", "--autoscale", "--autoscale-metrics-port", "18091"]
    controlled = Fleet(FleetSpec.from_settings(UpSettings.parse(args)))
    assert (18091, "autoscale metrics", "--autoscale-metrics-port") in controlled.wanted_ports()
    assert controlled.autoscale_metrics_url.endswith(":18091/metrics")


_WARM_FLAGS = (
    ("--kv-warm-min-tokens", "0"),
    ("--kv-warm-window-s", "2.5"),
    ("--kv-warm-requests-per-holder", "3"),
)


def test_prefix_warming_flags_reach_the_scheduler_with_the_scheduler_s_defaults() -> None:
    spec = FleetSpec.from_settings(UpSettings.parse([a for pair in _WARM_FLAGS for a in pair]))
    flags = spec.scheduler_flags()
    for flag, value in _WARM_FLAGS:
        assert flags[flags.index(flag) + 1] == value
    # The scheduler takes what up hands it.
    parsed = SchedulerSettings.parse(["--registry", "127.0.0.1:1", *flags])
    assert (parsed.kv_warm_min_tokens, parsed.kv_warm_window_s) == (0, 2.5)
    assert parsed.kv_warm_requests_per_holder == 3
    scheduler = SchedulerSettings.parse(["--registry", "127.0.0.1:1"])
    defaults = UpSettings.parse([])
    for flag, _ in _WARM_FLAGS:
        name = flag.removeprefix("--").replace("-", "_")
        assert getattr(defaults, name) == getattr(scheduler, name), name
    assert FleetSpec().scheduler_flags() == []  # the scheduler's own defaults or its env


def test_max_model_len_reaches_the_sims_only_when_given() -> None:
    given = FleetSpec.from_settings(
        UpSettings.parse(["--engine", "sim", "--max-model-len", "8192"])
    )
    assert given.sim_max_model_len == 8192
    # Not given: the sims keep their profile's context (a large profile's is not cut to 1024).
    assert FleetSpec.from_settings(UpSettings.parse(["--engine", "sim"])).sim_max_model_len is None
    options = SimOptions("kv_producer", 1, 2, "127.0.0.1:3", "prefill-0", "m", max_model_len=8192)
    argv = SimProcess(options, Path("/dev/null")).command()
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    plain = SimProcess(dataclasses.replace(options, max_model_len=None), Path("/dev/null"))
    assert "--max-model-len" not in plain.command()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--gateway-port", "26300", "--registry-port", "26300"],
            "--registry-port, --gateway-port",
        ),
        (
            ["--vllm-base-port", "26310", "--kv-base-port", "26311"],
            "--kv-base-port, --vllm-base-port",
        ),
        (["--scheduler-port", "26320", "--scheduler-metrics-port", "26320"], "scheduler metrics"),
    ],
)
def test_flags_that_give_one_port_twice_are_refused_before_anything_starts(
    argv: list[str], said: str
) -> None:
    fleet = Fleet(FleetSpec.from_settings(UpSettings.parse(["--engine", "sim", *argv])))
    with pytest.raises(PortsInUse, match="is given to both") as refused:
        fleet.start()
    assert said in str(refused.value)
    assert fleet.service_pids() == []  # nothing started
    assert Fleet(FleetSpec.from_settings(UpSettings.parse([]))).port_clash() is None
