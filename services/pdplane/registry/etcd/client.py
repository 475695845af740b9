"""A small etcd v3 client over `grpc.aio`: several endpoints with failover, TLS, deadlines.

The etcd v3 API comes from `aetcd` (its generated stubs and messages, `aetcd.rpc`). Its `Client`
dials one host without TLS, so the registry builds the channels itself: one per endpoint, the
current one used until a call to it fails with UNAVAILABLE or a deadline (a killed member, or
one cut off from the leader), then the next. Streams (watch, keep-alive) ask etcd to end them
when their member has no leader (`hasleader` metadata), so they move on too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.store import StoreError, StoreUnavailableError

__all__ = [
    "EtcdClient",
    "EtcdError",
    "absent",
    "delete_op",
    "parse_endpoints",
    "prefix_end",
    "put_op",
    "unchanged_since",
]

#: Statuses after which another endpoint may succeed. A member without a leader answers
#: UNKNOWN "context deadline exceeded" once its own request timeout passes.
_RETRY_ELSEWHERE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
}
#: etcd ends a stream at once when its member has no leader, instead of serving a stale view.
REQUIRE_LEADER = (("hasleader", "true"),)
_MAX_DETAIL = 200


class EtcdError(StoreError):
    """etcd refused a request for a reason another endpoint would not fix."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"etcd: {code.name}: {details}")
        self.code = code
        self.details = details


def parse_endpoints(endpoints: str) -> list[str]:
    """ "h1:2379,h2:2379" (an optional http:// or https:// in front of each is dropped) ->
    ["h1:2379", "h2:2379"]. Raises ValueError for an empty list or an entry without a port."""
    out = []
    for raw in endpoints.split(","):
        entry = raw.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {raw.strip()!r} is not host:port")
        out.append(entry)
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def prefix_end(prefix: bytes) -> bytes:
    """The etcd range end that covers every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def unchanged_since(key: bytes, mod_revision: int) -> rpc.Compare:
    """Transaction guard: `key` was not written since `mod_revision`."""
    return rpc.Compare(
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.MOD,
        key=key,
        mod_revision=mod_revision,
    )


def absent(key: bytes) -> rpc.Compare:
    """Transaction guard: `key` does not exist."""
    return rpc.Compare(
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.CREATE,
        key=key,
        create_revision=0,
    )


def put_op(key: bytes, value: bytes, lease: int) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def _credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    if not (ca or cert or key):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


class EtcdClient:
    """Unary calls and streams to an etcd cluster; create and use it on one event loop.

    `timeout_s` bounds each unary call, failovers included (s). Errors: `StoreUnavailableError`
    (no endpoint answered in time: members down, or no quorum; the message names the endpoints
    and the last gRPC status), `EtcdError` (anything else etcd refused).
    """

    def __init__(
        self,
        endpoints: list[str],
        *,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        timeout_s: float = 1.5,
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        creds = _credentials(ca, cert, key)
        options = [*grpc_util.CHANNEL_OPTIONS, *grpc_util.FAST_RECONNECT_OPTIONS]
        self._channels = [
            grpc.aio.secure_channel(e, creds, options=options)
            if creds is not None
            else grpc.aio.insecure_channel(e, options=options)
            for e in self.endpoints
        ]
        self._current = 0

    @property
    def endpoint(self) -> str:
        """The endpoint calls go to now."""
        return self.endpoints[self._current]

    def rotate(self) -> None:
        """Moves to the next endpoint (after a broken stream)."""
        self._current = (self._current + 1) % len(self.endpoints)

    def kv(self) -> rpc.KVStub:
        return rpc.KVStub(self._channels[self._current])

    def lease(self) -> rpc.LeaseStub:
        return rpc.LeaseStub(self._channels[self._current])

    def watch(self) -> rpc.WatchStub:
        return rpc.WatchStub(self._channels[self._current])

    async def call(self, service: str, method: str, request: Any) -> Any:
        """`service` ("kv", "lease", "maintenance") `.method(request)` on the current endpoint,
        then on the others while the deadline lasts."""
        deadline = time.monotonic() + self.timeout_s
        tries = len(self.endpoints)
        last = "no attempt"
        for attempt in range(tries):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # A hanging member (no leader) must not use up the whole deadline: give each of the
            # first tries an equal share of what is left.
            share = left / min(2, tries - attempt) if attempt < tries - 1 else left
            channel = self._channels[self._current]
            stub = _STUBS[service](channel)
            try:
                return await getattr(stub, method)(request, timeout=share)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY_ELSEWHERE:
                    raise EtcdError(exc.code(), (exc.details() or "")[:_MAX_DETAIL]) from None
                last = f"{self.endpoint}: {exc.code().name}: {(exc.details() or '')[:_MAX_DETAIL]}"
                self.rotate()
        raise StoreUnavailableError(
            f"etcd unavailable (no quorum or no endpoint reachable within "
            f"{self.timeout_s:.1f} s; endpoints {','.join(self.endpoints)}; last: {last})"
        )

    async def get(self, key: bytes) -> tuple[rpc.KeyValue | None, int]:
        """(the KV of `key` or None, etcd's revision), read linearizably."""
        reply = await self.call("kv", "Range", rpc.RangeRequest(key=key))
        return (reply.kvs[0] if reply.kvs else None), reply.header.revision

    async def txn(self, compare: rpc.Compare, *ops: rpc.RequestOp) -> tuple[bool, int]:
        """Runs `ops` if `compare` holds: (succeeded, etcd revision after the transaction)."""
        reply = await self.call("kv", "Txn", rpc.TxnRequest(compare=[compare], success=list(ops)))
        return reply.succeeded, reply.header.revision

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


_STUBS: dict[str, Any] = {
    "kv": rpc.KVStub,
    "lease": rpc.LeaseStub,
    "maintenance": rpc.MaintenanceStub,
}
