"""A published tokenizer crosses a real gRPC server on loopback: verified, bounded, cached.

Both server flavours serve it (the connector's sync server, the simulator's asyncio one); the
fetch checks every byte against the content hash, refuses what is not the tokenizer asked for,
and a 9 MB tokenizer (over gRPC's 4 MB message limit) arrives whole.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.core.tokenizer.bundle import collect, content_hash
from pdplane.core.tokenizer.fetch import FetchError, fetch_tokenizer
from pdplane.core.tokenizer.servicer import add_tokenizer_servicer
from pdplane.gateway.prompt_ids import PromptTokenizer
from pdplane.v1 import tokenizer_pb2, tokenizer_pb2_grpc

TOKEN = "fetch-test-token"
METADATA = grpc_util.token_metadata(TOKEN)


@pytest.fixture
async def aio_server() -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []

    async def start(published: Any, token: str | None = TOKEN) -> str:
        server = grpc.aio.server(interceptors=grpc_util.aio_server_interceptors(token))
        add_tokenizer_servicer(server, published)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(None)


@pytest.fixture
def sync_server() -> Iterator[Any]:
    servers: list[grpc.Server] = []

    def start(published: Any) -> str:
        server = grpc.server(
            futures.ThreadPoolExecutor(4), interceptors=grpc_util.server_interceptors(TOKEN)
        )
        add_tokenizer_servicer(server, published)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None).wait(2)


async def _fetch(address: str, want: str, cache: Path, **kw: Any) -> tuple[Path, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        return await fetch_tokenizer(channel, want, cache, metadata=METADATA, **kw)


def _same_files(a: Path, b: Path, names: list[str]) -> bool:
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


async def test_a_fetched_tokenizer_is_the_published_one_and_is_cached(
    tiny_model: Path, tmp_path: Path, aio_server: Any
) -> None:
    bundle = collect(tiny_model)
    address = await aio_server(bundle)
    directory, manifest = await _fetch(address, bundle.content_hash, tmp_path)
    assert manifest.content_hash == bundle.content_hash
    assert _same_files(directory, tiny_model, [f.name for f in bundle.files])
    assert directory.parent == tmp_path and not list(tmp_path.glob(".fetch-*"))
    # Cached: a second fetch of the same hash needs no server at all.
    again, _ = await fetch_tokenizer(
        grpc.aio.insecure_channel("127.0.0.1:9"), bundle.content_hash, tmp_path
    )
    assert again == directory


async def test_refusals_are_errors_that_say_why(
    tiny_model: Path, tmp_path: Path, aio_server: Any
) -> None:
    bundle = collect(tiny_model)
    address = await aio_server(bundle)
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(FetchError, match="UNAUTHENTICATED"):
            await fetch_tokenizer(channel, bundle.content_hash, tmp_path)
    with pytest.raises(FetchError, match="FAILED_PRECONDITION"):
        await _fetch(address, "sha256:" + "0" * 64, tmp_path)
    none = await aio_server("vLLM runs with --skip-tokenizer-init")
    with pytest.raises(FetchError, match=r"NOT_FOUND.*skip-tokenizer-init"):
        await _fetch(none, bundle.content_hash, tmp_path)
    with pytest.raises(FetchError, match="not a tokenizer content hash"):
        await _fetch(address, "../../etc", tmp_path)
    assert list(tmp_path.iterdir()) == []


def _big_tokenizer(tiny_model: Path, out: Path) -> Path:
    """The tiny tokenizer with 200,000 more vocabulary entries: a ~9 MB tokenizer.json, as
    large as Llama 3's."""
    out.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model / name, out / name)
    data = json.loads((tiny_model / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first = max(vocab.values()) + 1
    for i in range(200_000):
        vocab[f"pdplane{i:06d}-an-unreachable-vocabulary-entry"] = first + i
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


async def test_a_9mb_tokenizer_crosses_the_connectors_server(
    tiny_model: Path, tmp_path: Path, sync_server: Any
) -> None:
    big = _big_tokenizer(tiny_model, tmp_path / "big")
    size = (big / "tokenizer.json").stat().st_size
    assert size > 9_000_000 > grpc_util.CONTROL_MAX_RECEIVE_BYTES
    bundle = collect(big)
    address = sync_server(bundle)
    directory, _ = await _fetch(address, bundle.content_hash, tmp_path / "cache")
    assert (directory / "tokenizer.json").stat().st_size == size
    assert _same_files(directory, big, [f.name for f in bundle.files])
    fetched, original = PromptTokenizer(directory), PromptTokenizer(tiny_model)
    body = {"prompt": "Prefill then decode: the KV cache moves."}
    assert fetched.completion_ids(body, 0) == original.completion_ids(body, 0)


class _Forger(tokenizer_pb2_grpc.TokenizerFilesServicer):
    """Serves a manifest that hashes correctly but lies about names or bytes."""

    def __init__(self, files: dict[str, bytes], send: dict[str, bytes]) -> None:
        self.manifest = tokenizer_pb2.TokenizerManifest(
            files=[
                tokenizer_pb2.TokenizerFile(
                    name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest()
                )
                for n, b in files.items()
            ],
            tokenizer_mode="auto",
        )
        self.manifest.content_hash = content_hash(self.manifest)
        self.send = send

    async def Fetch(  # type: ignore[override]
        self, request: Any, context: Any
    ) -> AsyncIterator[tokenizer_pb2.TokenizerChunk]:
        yield tokenizer_pb2.TokenizerChunk(manifest=self.manifest)
        for name, data in self.send.items():
            yield tokenizer_pb2.TokenizerChunk(
                data=tokenizer_pb2.TokenizerFileData(name=name, offset=0, data=data)
            )


@pytest.mark.parametrize(
    ("files", "send", "why"),
    [
        ({"../evil.json": b"{}"}, {"../evil.json": b"{}"}, "not a tokenizer file"),
        ({"/etc/passwd": b"x"}, {"/etc/passwd": b"x"}, "not a tokenizer file"),
        ({"tokenizer.json": b"{}"}, {"tokenizer.json": b"{!"}, "do not match"),
        ({"tokenizer.json": b"{}"}, {"vocab.txt": b"{}"}, "out of manifest order"),
        ({"tokenizer.json": b"{}"}, {"tokenizer.json": b"{}{}"}, "past its size"),
        ({"tokenizer.json": b"{}", "vocab.txt": b"a"}, {"tokenizer.json": b"{}"}, "ended early"),
    ],
)
async def test_a_forged_stream_is_refused_and_writes_nothing(
    tmp_path: Path, files: dict[str, bytes], send: dict[str, bytes], why: str
) -> None:
    forger = _Forger(files, send)
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerFilesServicer_to_server(forger, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cache = tmp_path / "cache"
    try:
        with pytest.raises(FetchError, match=why):
            await _fetch(f"127.0.0.1:{port}", forger.manifest.content_hash, cache)
    finally:
        await server.stop(None)
    assert list(cache.iterdir()) == []  # no partial folder left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
