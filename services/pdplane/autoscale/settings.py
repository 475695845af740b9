"""The controller's flags, shared by `pdplane up --autoscale` and `pdplane autoscale`."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from pdplane.autoscale.controller import Controller, ControllerSettings
from pdplane.autoscale.predictor import Bounds, Predictor
from pdplane.core.settings import CommandSettings
from pdplane.plan.search import parse_slo
from pdplane.sim.profiles import load_profile

__all__ = ["AutoscaleOptions"]


class AutoscaleOptions(CommandSettings):
    """Controller flags (each also a `PDPLANE_*` environment variable)."""

    autoscale_profile: str = Field(
        "",
        description="engine profile the controller simulates fleets with (a `pdplane sim` "
        "profile name or a `pdplane profile` JSON file); '' = the default of the command",
    )
    slo: str = Field(
        "ttft_p90<=1s,itl_p90<=50ms", description="latency targets the fleet is sized for"
    )
    min_prefill: int = Field(1, ge=1, description="fewest prefill instances")
    max_prefill: int = Field(8, ge=1, description="most prefill instances")
    min_decode: int = Field(1, ge=1, description="fewest decode instances")
    max_decode: int = Field(8, ge=1, description="most decode instances")
    gpus: int = Field(
        0,
        ge=0,
        description="GPU budget: most GPUs held at once, draining instances included "
        "(0 = max-prefill + max-decode instances)",
    )
    gpus_per_instance: int = Field(1, ge=1, description="GPUs one instance holds (its TP size)")
    mean_gpus: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="spend target: mean GPUs held over --spend-window-s, e.g. the GPUs of the "
        "static split `pdplane plan` recommends for the average traffic; time below it earns "
        "credit, spent on more only where the plan meets the SLO; planned in whole instances "
        "(0 = none)",
    )
    spend_window_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="the spend target's rolling window (s)"
    )
    autoscale_interval_s: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="time between decisions (s)"
    )
    autoscale_window_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="traffic and load are measured over this sliding window (s)",
    )
    up_margin: float = Field(
        0.1,
        ge=0,
        allow_inf_nan=False,
        description="scale out to the plan for the measured rate x (1 + this)",
    )
    down_margin: float = Field(
        0.3,
        ge=0,
        allow_inf_nan=False,
        description="scale in only to the plan for the measured rate x (1 + this)",
    )
    scale_in_after_s: float = Field(
        60.0,
        ge=0,
        allow_inf_nan=False,
        description="a role shrinks only after it stayed above its line this long",
    )
    cooldown_s: float = Field(
        120.0,
        ge=0,
        allow_inf_nan=False,
        description="a role does not shrink sooner than this after it grew (s)",
    )
    instance_startup_s: float = Field(
        90.0,
        ge=0,
        allow_inf_nan=False,
        description="time from starting an instance until it serves (s): a prefill queue the "
        "ready instances serve within it starts nothing",
    )
    predict_measure_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="traffic each simulated fleet serves after its warm-up (s)",
    )
    drain_timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="longest wait for a drained instance to finish its requests (s)",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError("min-prefill/min-decode must not exceed max-prefill/max-decode")
        if self.down_margin < self.up_margin:
            raise ValueError("down-margin must be at least up-margin (the hysteresis band)")
        smallest = (self.min_prefill + self.min_decode) * self.gpus_per_instance
        if self.gpus and self.gpus < smallest:
            raise ValueError(
                f"gpus {self.gpus} is below the {smallest} GPUs that min-prefill + min-decode "
                "instances hold"
            )
        if self.mean_gpus and self.mean_gpus < smallest:
            raise ValueError(
                f"mean-gpus {self.mean_gpus:g} is below the {smallest} GPUs that min-prefill + "
                "min-decode instances hold"
            )
        cap = self.gpus or (self.max_prefill + self.max_decode) * self.gpus_per_instance
        if self.mean_gpus > cap:
            raise ValueError(
                f"mean-gpus {self.mean_gpus:g} is above the {cap} GPUs the fleet may hold at "
                "once (--gpus, else max-prefill + max-decode instances): a target it can never "
                "reach is no target"
            )
        if self.autoscale_window_s < self.autoscale_interval_s:
            raise ValueError(
                "autoscale-window-s must be at least autoscale-interval-s (traffic between two "
                "decisions would go unmeasured)"
            )
        return self

    def bounds(self) -> Bounds:
        return Bounds(
            self.min_prefill,
            self.max_prefill,
            self.min_decode,
            self.max_decode,
            self.gpus,
            self.gpus_per_instance,
        )

    def controller(self, default_profile: str) -> Controller:
        """The controller these flags describe. Raises ValueError for a bad SLO or profile."""
        profile = load_profile(self.autoscale_profile or default_profile)
        predictor = Predictor(profile, parse_slo(self.slo), measure_s=self.predict_measure_s)
        settings = ControllerSettings(
            up_margin=self.up_margin,
            down_margin=self.down_margin,
            scale_in_after_s=self.scale_in_after_s,
            cooldown_s=self.cooldown_s,
            startup_s=self.instance_startup_s,
            min_span_s=min(30.0, self.autoscale_window_s / 2),
            mean_gpus=self.mean_gpus,
            spend_window_s=self.spend_window_s,
        )
        return Controller(predictor, self.bounds(), settings)
