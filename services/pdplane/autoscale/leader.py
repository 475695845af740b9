"""One controller at a time: a leader lease on etcd (when the registry runs on etcd).

The leader holds key `<prefix>autoscale/<model>/leader` on its own etcd lease (TTL
`ttl_s`): created only when absent (a transaction), renewed at every check, gone when the
leader stops renewing it, after which any replica takes it at its next check. A replica that
cannot reach etcd is not the leader (it stops acting rather than risk two controllers acting
at once). With an in-memory registry there is one controller replica (the chart refuses more)
and no lease.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from aetcd import rpc

from pdplane.registry.etcd.client import EtcdClient, absent, put_op
from pdplane.registry.etcd.lease import describe

__all__ = ["EtcdLeader"]

log = logging.getLogger(__name__)


class EtcdLeader:
    """`is_leader()` renews (or takes) the lease and says whether this replica leads.

    Call it more often than every `ttl_s` / 2 (the control loop's interval). Uses its own event
    loop (the control loop is synchronous)."""

    def __init__(
        self,
        endpoints: list[str],
        key: str,
        *,
        ttl_s: int = 15,
        identity: str = "",
        ca: str | None = None,
        cert: str | None = None,
        cert_key: str | None = None,
    ) -> None:
        self.key = key.encode()
        self.ttl_s = ttl_s
        self.identity = (identity or uuid.uuid4().hex).encode()
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(self._make(endpoints, ca, cert, cert_key))
        self.lease = 0
        self.leading = False

    @staticmethod
    async def _make(
        endpoints: list[str], ca: str | None, cert: str | None, key: str | None
    ) -> EtcdClient:
        return EtcdClient(endpoints, ca=ca, cert=cert, key=key)

    def is_leader(self) -> bool:
        try:
            leading = self._loop.run_until_complete(self._check())
        except Exception as exc:  # etcd down or refusing: not the leader
            log.warning("autoscale leader lease: %s", describe(exc))
            self.lease = 0
            leading = False
        if leading != self.leading:
            log.warning("autoscale: %s", "leading" if leading else "not leading")
        self.leading = leading
        return leading

    async def _renew(self) -> None:
        if self.lease:
            call = self._client.lease().LeaseKeepAlive()
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=self.lease))
                reply = await asyncio.wait_for(call.read(), self._client.timeout_s)
            finally:
                call.cancel()
            if reply is not None and getattr(reply, "TTL", 0) > 0:
                return
        grant = await self._client.call(
            "lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=self.ttl_s)
        )
        self.lease = grant.ID

    async def _check(self) -> bool:
        await self._renew()
        taken, _ = await self._client.txn(
            absent(self.key), put_op(self.key, self.identity, self.lease)
        )
        if taken:
            return True
        kv, _ = await self._client.get(self.key)
        return kv is not None and kv.value == self.identity and kv.lease == self.lease

    def close(self) -> None:
        """Gives the lead up at once (revokes the lease) and closes the client."""

        async def _close() -> None:
            if self.lease:
                try:
                    await self._client.call(
                        "lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=self.lease)
                    )
                except Exception as exc:  # the TTL ends it anyway
                    log.info("autoscale: lease revoke failed: %s", describe(exc))
            await self._client.close()

        self._loop.run_until_complete(_close())
        self._loop.close()
