#!/usr/bin/env python3
"""Container health probe: `pdplane-healthcheck grpc HOST:PORT` or `... http URL`.

Installed in the images as `/usr/local/bin/pdplane-healthcheck` and used by the compose
healthchecks (the slim images have no curl or grpc_health_probe).

- `grpc TARGET [--service NAME] [--tls-ca PEM] [--tls-server-name NAME]`: calls
  `grpc.health.v1.Health/Check` (NAME "" = the whole server); healthy when SERVING.
  Health stays open when the server requires a bearer token, so no token is needed.
- `http URL`: healthy when a GET answers 2xx (e.g. the gateway's `/health`, which is 503 while
  no usable prefill/decode pair is registered, or a vLLM instance's `/health`).

Exit status: 0 healthy, 1 unhealthy or unreachable (one line on stderr says why), 2 usage.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_grpc(
    target: str,
    service: str,
    timeout_s: float,
    tls_ca: str | None = None,
    tls_server_name: str | None = None,
) -> str | None:
    """Returns None when `target` reports SERVING for `service`, else the reason (a string)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdplane.core.grpc.util import channel

    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    with channel(target, tls_ca=tls_ca, extra_options=options) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{target}: {exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{target}: service {service!r} is {status}"
    return None


def check_http(url: str, timeout_s: float) -> str | None:
    """Returns None when GET `url` answers 2xx within `timeout_s`, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status = int(resp.status)
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}: {exc.read(200).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"
    return None if 200 <= status < 300 else f"{url}: HTTP {status}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdplane-healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per probe")
    sub = parser.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("grpc", help="grpc.health.v1 Check")
    g.add_argument("target", help="HOST:PORT")
    g.add_argument("--service", default="", help='service name ("" = whole server)')
    g.add_argument("--tls-ca", default=None, help="PEM CA bundle: probe over TLS")
    g.add_argument("--tls-server-name", default=None, help="name the certificate is issued to")
    h = sub.add_parser("http", help="HTTP GET, healthy on 2xx")
    h.add_argument("url")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.kind == "grpc":
        reason = check_grpc(
            args.target, args.service, args.timeout, args.tls_ca, args.tls_server_name
        )
    else:
        reason = check_http(args.url, args.timeout)
    if reason:
        sys.stderr.write(f"unhealthy: {reason}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
