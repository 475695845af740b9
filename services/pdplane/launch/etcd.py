"""Local etcd members on loopback: `pdplane up --store etcd`, the tests' 3-member cluster, benches.

Runs the `etcd` binary (Debian's `etcd-server` package; `deploy/local.sh` installs it) as
supervised children. Each member listens for clients and peers on 127.0.0.1 only. Data lives in
`data_dir/<name>`; a member started again over its data directory rejoins its cluster.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdplane.launch.ports import free_port_run
from pdplane.launch.process import ManagedProcess, http_ok

__all__ = ["EtcdCluster", "etcd_binary", "member_argv"]


def etcd_binary() -> str | None:
    """Path of the `etcd` server binary, or None when it is not installed."""
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).is_file()), None
    )


def member_argv(
    binary: str,
    name: str,
    data_dir: Path,
    client_port: int,
    peer_port: int,
    cluster: str = "",
    *,
    existing: bool = False,
    token: str = "pdplane",
    fast_elections: bool = True,
) -> list[str]:
    """The command line of one etcd member on 127.0.0.1 (`cluster`: "name=peer-url,...";
    empty: a cluster of this member alone). `fast_elections`: heartbeat 50 ms, election 500 ms
    (a killed leader is replaced within about a second; leases of 1 s are allowed)."""
    peer_url = f"http://127.0.0.1:{peer_port}"
    client_url = f"http://127.0.0.1:{client_port}"
    argv = [
        binary,
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={cluster or f'{name}={peer_url}'}",
        f"--initial-cluster-state={'existing' if existing else 'new'}",
        f"--initial-cluster-token={token}",
        "--logger=zap",
        "--log-level=warn",
    ]
    if fast_elections:
        argv += ["--heartbeat-interval=50", "--election-timeout=500"]
    return argv


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    process: ManagedProcess | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


@dataclass
class EtcdCluster:
    """`size` etcd members on loopback (fresh ports), data under `data_dir`.

    `fast_elections` shortens the raft timings (heartbeat 50 ms, election 500 ms) so that a
    killed leader is replaced within about a second and leases of 1 s are allowed (etcd's
    minimum lease TTL is 1.5 election timeouts); without it etcd's defaults apply.
    """

    data_dir: Path
    size: int = 3
    fast_elections: bool = True
    token: str = "pdplane"
    members: list[_Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        ports = free_port_run(2 * self.size)
        self.members = [
            _Member(f"m{i}", ports + 2 * i, ports + 2 * i + 1) for i in range(self.size)
        ]

    @property
    def endpoints(self) -> str:
        """The client endpoints, "127.0.0.1:p1,127.0.0.1:p2,..." (`--etcd-endpoints`)."""
        return ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def _argv(self, member: _Member, binary: str, existing: bool) -> list[str]:
        return member_argv(
            binary,
            member.name,
            self.data_dir / member.name,
            member.client_port,
            member.peer_port,
            ",".join(f"{m.name}={m.peer_url}" for m in self.members),
            existing=existing,
            token=self.token,
            fast_elections=self.fast_elections,
        )

    def start_member(self, index: int) -> None:
        """Starts member `index` (again: over its data directory, rejoining the cluster)."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        member = self.members[index]
        existing = (self.data_dir / member.name / "member").exists()
        member.process = ManagedProcess(
            f"etcd-{member.name}",
            self._argv(member, binary, existing),
            self.data_dir / f"{member.name}.log",
        )
        member.process.start()

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts every member and waits until the cluster answers /health."""
        for i in range(self.size):
            self.start_member(i)
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float, indexes: list[int] | None = None) -> None:
        """Waits until the members `indexes` (default all running ones) report a healthy
        cluster (a leader, quorum); raises RuntimeError with a log tail after `timeout_s`."""
        chosen = (
            [self.members[i] for i in indexes]
            if indexes is not None
            else [m for m in self.members if m.process is not None and m.process.alive()]
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in chosen:
                assert m.process is not None
                m.process.check_alive()
            if all(http_ok(f"{m.client_url}/health", timeout_s=1.0) for m in chosen):
                return
            time.sleep(0.1)
        tails = "\n".join(m.process.tail(10) for m in chosen if m.process is not None)
        raise RuntimeError(f"etcd cluster not healthy after {timeout_s:.0f} s:\n{tails}")

    def ensure_running(self, timeout_s: float) -> None:
        """Starts every member that is not running and waits for a healthy cluster."""
        for i, member in enumerate(self.members):
            if member.process is None or not member.process.alive():
                self.start_member(i)
        self.wait_healthy(timeout_s)

    def kill(self, index: int) -> None:
        """SIGKILL of member `index` (a crash)."""
        process = self.members[index].process
        if process is not None:
            process.kill()

    def stop(self) -> None:
        """Stops every member."""
        for member in self.members:
            if member.process is not None:
                member.process.stop(grace_s=5.0)
