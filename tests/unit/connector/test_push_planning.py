"""Push mode's decisions: which prompts prefill's scheduler side pushes (vLLM's real Request
and KVCacheBlocks), how the worker-side Pusher drives a transport's sessions from vLLM's
per-layer hooks, and the NCCL transport's push wiring (fakes: no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.metadata import PushSpec
from pdplane.connector.peers import PeerPool
from pdplane.connector.pushes import Pusher
from pdplane.connector.scheduler_side import SchedulerSide
from pdplane.connector.transports.base import TransferError
from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams
from tests.unit.connector.conftest import make_blocks, make_request

PUSH = ConnectorConfig(kv_port=50100, mode="push")
DECODE_EP = "127.0.0.1:50200"


def _prefill_params() -> dict:
    return PrefillRequestParams("gw-1", "decode-0", DECODE_EP).to_dict()


def _new_req(req: Any, block_ids: list[int], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        block_ids=(block_ids,),
        num_computed_tokens=computed,
    )


def _step(side: SchedulerSide, req: Any, block_ids: list[int], scheduled: int) -> Any:
    side.update_state_after_alloc(req, make_blocks(block_ids), 0)
    out = SimpleNamespace(
        num_scheduled_tokens={req.request_id: scheduled},
        scheduled_new_reqs=[_new_req(req, block_ids)],
    )
    return side.build_connector_meta(out)


def _finish(side: SchedulerSide, req: Any, block_ids: list[int]) -> DecodeRequestParams:
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = side.request_finished(req, block_ids)
    assert delay is True and params is not None
    return DecodeRequestParams.from_dict(params)


def test_a_prompt_computed_in_one_step_is_pushed_under_the_returned_transfer_id(
    layout,
) -> None:
    side = SchedulerSide(PUSH, "prefill-a", layout)
    req = make_request("cmpl-a-0-1", 10, _prefill_params())
    meta = _step(side, req, [7, 3, 9, 11], scheduled=10)
    (push,) = meta.pushes
    assert push.endpoint == DECODE_EP and push.block_ids == (7, 3, 9)  # ceil(10 / 4) blocks
    dp = _finish(side, req, [7, 3, 9, 11])
    assert dp.pushed is True
    assert dp.transfer_id == push.transfer_id and dp.transfer_id.startswith("gw-1.")


def test_a_prompt_split_over_steps_is_not_pushed(layout) -> None:
    side = SchedulerSide(PUSH, "prefill-a", layout)
    req = make_request("cmpl-a-0-2", 10, _prefill_params())
    meta = _step(side, req, [7, 3], scheduled=8)  # chunked prefill: 8 of 10 tokens
    assert meta.pushes == []
    assert _finish(side, req, [7, 3, 9]).pushed is False


def test_pull_mode_never_pushes_even_with_a_decode_target(layout) -> None:
    side = SchedulerSide(ConnectorConfig(kv_port=50100), "prefill-a", layout)
    req = make_request("cmpl-a-0-3", 10, _prefill_params())
    assert _step(side, req, [7, 3, 9], scheduled=10).pushes == []
    assert _finish(side, req, [7, 3, 9]).pushed is False


def test_no_decode_target_means_pull(layout) -> None:
    side = SchedulerSide(PUSH, "prefill-a", layout)
    req = make_request("cmpl-a-0-4", 10, PrefillRequestParams("gw-1").to_dict())
    assert _step(side, req, [7, 3, 9], scheduled=10).pushes == []
    assert _finish(side, req, [7, 3, 9]).pushed is False


def test_decode_loads_pushed_params_with_the_sender_named(layout) -> None:
    side = SchedulerSide(PUSH, "decode-0", layout)
    params = DecodeRequestParams(
        request_id="gw-1",
        transfer_id="gw-1.ab",
        engine_id="prefill-a",
        kv_endpoint="127.0.0.1:50100",
        block_ids=[7, 3, 9],
        num_tokens=10,
        kv_layout=side.fingerprint,
        pushed=True,
    ).to_dict()
    req = make_request("cmpl-d-0-1", 10, params)
    assert side.get_num_new_matched_tokens(req, 0) == (10, True)
    side.update_state_after_alloc(req, make_blocks([1, 2, 4]), 10)
    (load,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).loads
    assert load.pushed and load.sender_id == "prefill-a"
    assert load.local_block_ids == (1, 2, 4) and load.remote_block_indices == (0, 1, 2)


# -- Pusher ------------------------------------------------------------------------------------


class FakeSession:
    def __init__(self, log: list[tuple], fail_layer: int | None = None) -> None:
        self.log, self.fail_layer = log, fail_layer

    def send_layer(self, layer: int) -> None:
        if layer == self.fail_layer:
            raise TransferError("decode went away", grpc.StatusCode.UNAVAILABLE)
        self.log.append(("send", layer))

    def finish(self) -> int:
        self.log.append(("finish",))
        return 0

    def abort(self, reason: str) -> None:
        self.log.append(("abort", reason))


class FakeTransport:
    def __init__(self, fail_layer: int | None = None, refuse: Exception | None = None) -> None:
        self.log: list[tuple] = []
        self.opened: list[tuple] = []
        self.fail_layer, self.refuse = fail_layer, refuse

    def push_session(
        self, peer, requester_id, items, layout, deadline, tp_rank=0, peer_id=""
    ) -> FakeSession:
        if self.refuse is not None:
            raise self.refuse
        self.opened.append((peer.endpoint, requester_id, [tid for tid, _ in items], tp_rank))
        return FakeSession(self.log, self.fail_layer)


def _pusher(transport: Any, layout: Any) -> Pusher:
    pusher = Pusher(transport, PeerPool(), layout, "prefill-a", tp_rank=1)
    pusher.bind_layers([f"model.layers.{i}.self_attn.attn" for i in range(2)])
    return pusher


SPECS = [
    PushSpec("r1", "t1", "127.0.0.1:50200", (1, 2)),
    PushSpec("r2", "t2", "127.0.0.1:50200", (3,)),
    PushSpec("r3", "t3", "127.0.0.1:50300", (4,)),
]


def test_pusher_opens_one_session_per_decode_and_follows_the_layers(layout) -> None:
    transport = FakeTransport()
    pusher = _pusher(transport, layout)
    pusher.start(SPECS)
    # rank 1 pushes to decode's rank 1 (port + 1)
    assert transport.opened == [
        ("127.0.0.1:50201", "prefill-a", ["t1", "t2"], 1),
        ("127.0.0.1:50301", "prefill-a", ["t3"], 1),
    ]
    pusher.save_layer("model.layers.0.self_attn.attn")
    pusher.save_layer("model.layers.9.cross_attn")  # not a KV cache layer: ignored
    pusher.save_layer("model.layers.1.self_attn.attn")
    pusher.finish()
    assert transport.log == [("send", 0), ("send", 0), ("send", 1), ("send", 1)] + [("finish",)] * 2
    assert not pusher.active


def test_pusher_aborts_a_failing_session_and_keeps_the_forward_going(layout) -> None:
    transport = FakeTransport(fail_layer=1)
    pusher = _pusher(transport, layout)
    pusher.start(SPECS[:1])
    pusher.save_layer("model.layers.0.self_attn.attn")
    pusher.save_layer("model.layers.1.self_attn.attn")  # raises inside: must not escape
    pusher.finish()
    assert transport.log == [("send", 0), ("abort", "decode went away")]


@pytest.mark.parametrize(
    "error", [TransferError("full", grpc.StatusCode.RESOURCE_EXHAUSTED), RuntimeError("bug")]
)
def test_pusher_skips_a_session_that_cannot_open(layout, error: Exception) -> None:
    pusher = _pusher(FakeTransport(refuse=error), layout)
    pusher.start(SPECS)
    pusher.save_layer("model.layers.0.self_attn.attn")
    pusher.finish()
    assert not pusher.active and pusher.started == 0


def test_a_step_without_wait_for_save_finishes_before_the_next_starts(layout) -> None:
    transport = FakeTransport()
    pusher = _pusher(transport, layout)
    pusher.start(SPECS[:1])
    pusher.start(SPECS[2:])
    assert transport.log == [("finish",)]


# -- NCCL wiring (no GPU) ----------------------------------------------------------------------


def _receiver(taken: list[tuple]) -> Any:
    from pdplane.connector.transports.nccl.push import PushReceiver  # import-safe on CPU

    receiver = PushReceiver(SimpleNamespace(), gpu_bytes=0, host_bytes=0)  # type: ignore[arg-type]

    def take(transfer_id: str, local_ids: Any, deadline: float) -> int:
        taken.append((transfer_id, list(local_ids)))
        return 123

    receiver._take = take  # type: ignore[method-assign]
    return receiver


def test_nccl_receiver_takes_whole_transfers() -> None:
    taken: list[tuple] = []
    receiver = _receiver(taken)
    n = receiver.take("t1", [5, 6], 1e12, sender_id="p", remote_block_indices=[0, 1])
    assert n == 123 and taken == [("t1", [5, 6])]
    receiver.close()


def test_nccl_receiver_refuses_part_of_a_transfer_so_decode_pulls() -> None:
    taken: list[tuple] = []
    receiver = _receiver(taken)
    with pytest.raises(TransferError) as info:
        receiver.take("t1", [6], 1e12, remote_block_indices=[1])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and taken == []
    receiver.discard("t1", "pulled instead")  # nothing received: a no-op
    receiver.close()


def test_nccl_transport_before_bind_has_no_receive_buffer() -> None:
    from pdplane.connector.transports.nccl import NcclTransport

    assert NcclTransport().receive_buffer is None
