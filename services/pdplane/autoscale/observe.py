"""What the controller observes of one model's fleet over a sliding window.

Every instance is sampled as vLLM exposes it (counters of its `/metrics`: finished requests,
prompt and generated tokens; and the load report every instance heartbeats to the registry:
running and waiting requests, KV cache usage). Two samples of the same instance give its
deltas; the window's traffic follows (`TrafficWindow.traffic`):

- arrival rate (req/s) = prefill completions + growth of the prefill queues (running +
  waiting), over the window's span, + what the gateway held back: the growth of the requests
  waiting at its flow control and those it shed or timed out there (a sample of role
  "gateway", `pdplane.autoscale.scrape.gateway_demand`; in an overload the instances' queues
  stop growing at the in-flight budget while the demand goes on);
- mean prompt length (tokens) = prompt tokens / the prefill instances' arrivals;
- mean output length (tokens) = generated tokens / completions (decode instances; in steady
  state a decode finishes one request per `osl` tokens it generates).

The same window is fed by the live observer (`pdplane.autoscale.live`) and by the modelled
fleet (`pdplane.autoscale.elastic`), so the controller sees the same quantities in both.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from pdplane.plan.live import RoleLoad, mean_loads

__all__ = ["GATEWAY", "InstanceSample", "Observation", "Traffic", "TrafficWindow"]

#: the key of the gateway's sample among the instances' (not an instance id: ids have no
#: parentheses in `pdplane up`, and a collision would only merge two samples' counts)
GATEWAY = "(gateway)"


@dataclass(frozen=True, slots=True)
class InstanceSample:
    """One instance at one time: `role` prefill | decode; counters since it started
    (requests finished, prompt tokens, generated tokens) and its load now. Role "gateway":
    `finished` = requests the gateway shed or timed out so far, `waiting` = requests waiting
    at its flow control now (module docstring)."""

    role: str
    finished: float
    prompt_tokens: float
    generation_tokens: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class Traffic:
    """Arrival rate (req/s) and mean prompt / output lengths (tokens) of a window."""

    rate: float
    isl: float
    osl: float

    @property
    def known(self) -> bool:
        return self.rate > 0 and self.isl > 0 and self.osl > 0

    def scaled(self, factor: float) -> Traffic:
        """The same lengths at `factor` x the rate."""
        return Traffic(self.rate * factor, self.isl, self.osl)


def _increase(seen: list[InstanceSample]) -> tuple[float, float, float]:
    """What one instance's counters (finished, prompt tokens, generation tokens) grew by
    over its samples `seen`, oldest first. A counter lower than in the sample before means
    the instance restarted under the same id (its counters begin again at zero): that step
    adds the new values, as Prometheus' `increase()` reads a counter reset."""
    finished = prompt = generated = 0.0
    for before, after in itertools.pairwise(seen):
        reset = (
            after.finished < before.finished
            or after.prompt_tokens < before.prompt_tokens
            or after.generation_tokens < before.generation_tokens
        )
        base = (
            (0.0, 0.0, 0.0)
            if reset
            else (before.finished, before.prompt_tokens, before.generation_tokens)
        )
        finished += after.finished - base[0]
        prompt += after.prompt_tokens - base[1]
        generated += after.generation_tokens - base[2]
    return finished, prompt, generated


@dataclass(slots=True)
class Observation:
    """The window the controller decides on: traffic, per-role mean load per instance, and the
    window's TTFT / ITL p90 (s; NaN when unknown)."""

    traffic: Traffic
    loads: dict[str, RoleLoad]
    ttft_p90_s: float = math.nan
    itl_p90_s: float = math.nan
    span_s: float = 0.0
    #: the traffic of the window's last quarter: a rise shows here first
    recent: Traffic = Traffic(0.0, 0.0, 0.0)
    #: requests waiting on the prefill instances now and a quarter of the window ago (NaN:
    #: not sampled then)
    queued: float = 0.0
    queued_before: float = math.nan


@dataclass(slots=True)
class TrafficWindow:
    """Instance samples over the last `window_s` seconds (any monotonic clock)."""

    window_s: float
    samples: deque[tuple[float, dict[str, InstanceSample]]] = field(default_factory=deque)

    def add(self, now: float, instances: dict[str, InstanceSample]) -> None:
        """Records every serving instance (by id) at `now`; drops samples older than the
        window (one older sample is kept as the window's start)."""
        self.samples.append((now, dict(instances)))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()

    @property
    def span_s(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if len(self.samples) > 1 else 0.0

    def traffic(self, last_s: float | None = None) -> Traffic:
        """The window's traffic, or that of its last `last_s` seconds (zeros before two
        samples or with nothing finished)."""
        samples = list(self.samples)
        if last_s is not None:
            now = samples[-1][0] if samples else 0.0
            older = [i for i, (t, _) in enumerate(samples) if t <= now - last_s]
            samples = samples[older[-1] :] if older else samples
        span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
        if span <= 0:
            return Traffic(0.0, 0.0, 0.0)
        new = samples[-1][1]
        done = prompt = queue = gen = dec_done = held = 0.0
        for iid, s in new.items():
            # The instance's samples in the window (one that started inside the window, or
            # whose earlier scrapes failed, counts from its first one).
            seen = [rows[iid] for _, rows in samples if iid in rows]
            base = seen[0]
            finished, prompts, generated = _increase(seen)
            if s.role == "prefill":
                done += finished
                prompt += prompts
                queue += s.running + s.waiting - (base.running + base.waiting)
            elif s.role == "decode":
                gen += generated
                dec_done += finished
            elif s.role == "gateway":
                held += finished + s.waiting - base.waiting
        arrivals = max(done + queue, 0.0)
        isl = prompt / arrivals if arrivals > 0 else 0.0
        osl = gen / dec_done if dec_done > 0 else 0.0
        return Traffic(max(arrivals + held, 0.0) / span, isl, osl)

    def waiting(self, role: str, ago_s: float = 0.0) -> float:
        """Requests waiting on the instances of `role` in the last sample at least `ago_s`
        old (NaN when there is none); for "prefill", with those waiting at the gateway for
        their turn (they wait for a prefill too)."""
        roles = ("prefill", "gateway") if role == "prefill" else (role,)
        now = self.samples[-1][0] if self.samples else 0.0
        for t, rows in reversed(self.samples):
            if t <= now - ago_s:
                return sum(s.waiting for s in rows.values() if s.role in roles)
        return math.nan

    def observation(self, ttft_p90_s: float, itl_p90_s: float) -> Observation:
        """The window's `Observation` with the gateway's TTFT / ITL p90 (s; NaN: unknown)."""
        quarter = self.window_s / 4
        return Observation(
            self.traffic(),
            self.loads(),
            ttft_p90_s,
            itl_p90_s,
            self.span_s,
            self.traffic(quarter),
            self.waiting("prefill") if self.samples else 0.0,
            self.waiting("prefill", quarter),
        )

    def loads(self) -> dict[str, RoleLoad]:
        """Mean load per instance of each role over the window's samples (`RoleLoad`)."""
        return mean_loads(
            [
                (s.role, s.running, s.waiting, s.kv_usage)
                for s in rows.values()
                if s.role != "gateway"
            ]
            for _, rows in self.samples
        )
