"""Fetching a published tokenizer (`pdplane.v1.TokenizerFiles.Fetch`) into a local directory.

The receiver trusts nothing it is sent: every file name must be one a tokenizer loads from
(`bundle.collect` publishes only those; a name with "..", a slash it does not know, or any
other name is refused), sizes and SHA-256 digests must match the manifest, the manifest must
hash to its `content_hash`, which must be the hash asked for, and the whole bundle is bounded
by `MAX_BUNDLE_BYTES`. Files are written to a fresh directory that is renamed into place only
once complete, so a directory named by a hash always holds exactly that tokenizer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

import grpc

from pdplane.core.tokenizer.bundle import MAX_BUNDLE_BYTES, content_hash, valid_hash
from pdplane.v1 import tokenizer_pb2, tokenizer_pb2_grpc

__all__ = ["MANIFEST_FILE", "FetchError", "cached_dir", "fetch_tokenizer", "load_manifest"]

#: The manifest as received (protobuf binary), beside the files it lists.
MANIFEST_FILE = ".pdplane-manifest.pb"
_MAX_FILES = 64
_MAX_NAME = 200


class FetchError(Exception):
    """The fetch failed or what came was not the tokenizer asked for; one bounded line."""


def _safe_name(name: str) -> bool:
    parts = name.split("/")
    return (
        0 < len(name) <= _MAX_NAME
        and len(parts) <= 2
        and all(p and p not in (".", "..") and p.isprintable() and "\\" not in p for p in parts)
        and not name.startswith(".")
        and (len(parts) == 1 or parts[0] == "additional_chat_templates")
    )


def _check_manifest(manifest: tokenizer_pb2.TokenizerManifest, want: str) -> None:
    if manifest.content_hash != want:
        raise FetchError(f"the instance serves tokenizer {manifest.content_hash[:80]!r} now")
    if content_hash(manifest) != want:
        raise FetchError("the manifest does not hash to its content hash")
    if len(manifest.files) > _MAX_FILES:
        raise FetchError(f"more than {_MAX_FILES} files")
    names = [f.name for f in manifest.files]
    if len(set(names)) != len(names) or not all(_safe_name(n) for n in names):
        raise FetchError("a file name that is not a tokenizer file's")
    if sum(f.size for f in manifest.files) > MAX_BUNDLE_BYTES:
        raise FetchError(f"more than {MAX_BUNDLE_BYTES} bytes of files")


def cached_dir(cache: Path, want: str) -> Path:
    """Where the tokenizer of content hash `want` lives under `cache` once fetched."""
    return cache / want.removeprefix("sha256:")


def load_manifest(directory: Path) -> tokenizer_pb2.TokenizerManifest | None:
    """The manifest a completed fetch left in `directory`; None when there is none."""
    try:
        data = (directory / MANIFEST_FILE).read_bytes()
    except OSError:
        return None
    manifest = tokenizer_pb2.TokenizerManifest()
    manifest.ParseFromString(data)
    return manifest


async def fetch_tokenizer(
    channel: grpc.aio.Channel,
    want: str,
    cache: Path,
    *,
    metadata: tuple[tuple[str, str], ...] = (),
    timeout_s: float = 60.0,
) -> tuple[Path, tokenizer_pb2.TokenizerManifest]:
    """Fetches the tokenizer of content hash `want` over `channel` into `cache`.

    Returns (its directory, its manifest); a directory already complete under `cache` is
    returned without a call. The whole stream is bounded by `timeout_s` (s).

    Raises:
        FetchError: the call failed (its gRPC status and bounded details), or what came was not
            `want` (a bad name, size, digest or hash), or the directory could not be written.
    """
    if not valid_hash(want):
        raise FetchError("not a tokenizer content hash")
    final = cached_dir(cache, want)
    done = load_manifest(final)
    if done is not None and done.content_hash == want:
        return final, done
    try:
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    except OSError as exc:
        raise FetchError(f"cannot write {cache}: {exc.strerror}") from None
    try:
        manifest = await _receive(channel, want, work, metadata, timeout_s)
        (work / MANIFEST_FILE).write_bytes(manifest.SerializeToString())
        try:
            os.rename(work, final)
        except OSError:
            # Another fetch of the same hash completed first: same content, keep it.
            if load_manifest(final) is None:
                raise
        return final, manifest
    except OSError as exc:
        raise FetchError(f"cannot write {cache}: {exc.strerror}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Writer:
    """Writes the files of `manifest` into `work` as their data arrives, in manifest order,
    checking order, offsets, sizes and digests."""

    def __init__(self, manifest: tokenizer_pb2.TokenizerManifest, work: Path) -> None:
        self._files = list(manifest.files)
        self._work = work
        self._index = 0
        self._written = 0
        self._digest = hashlib.sha256()
        self._out: BinaryIO | None = None

    def _advance(self) -> None:
        """Closes every file whose bytes are complete (zero-byte ones included)."""
        while self._index < len(self._files) and self._written == self._files[self._index].size:
            entry = self._files[self._index]
            if self._out is None:  # nothing came for it: an empty file
                (self._work / entry.name).parent.mkdir(parents=True, exist_ok=True)
                (self._work / entry.name).touch()
            else:
                self._out.close()
                self._out = None
            if self._digest.hexdigest() != entry.sha256:
                raise FetchError(f"file {entry.name!r}: its bytes do not match the manifest")
            self._index, self._written, self._digest = self._index + 1, 0, hashlib.sha256()

    def add(self, data: tokenizer_pb2.TokenizerFileData) -> None:
        self._advance()
        if self._index >= len(self._files) or data.name != self._files[self._index].name:
            raise FetchError("file data out of manifest order")
        entry = self._files[self._index]
        if data.offset != self._written or self._written + len(data.data) > entry.size:
            raise FetchError(f"file {entry.name!r}: data at a wrong offset or past its size")
        if self._out is None:
            path = self._work / entry.name
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out = path.open("wb")
        self._out.write(data.data)
        self._digest.update(data.data)
        self._written += len(data.data)

    def finish(self) -> None:
        """Checks that every file came whole."""
        self._advance()
        if self._index < len(self._files):
            raise FetchError(f"file {self._files[self._index].name!r}: the stream ended early")

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


async def _receive(
    channel: grpc.aio.Channel,
    want: str,
    work: Path,
    metadata: tuple[tuple[str, str], ...],
    timeout_s: float,
) -> tokenizer_pb2.TokenizerManifest:
    stub = tokenizer_pb2_grpc.TokenizerFilesStub(channel)
    call = stub.Fetch(
        tokenizer_pb2.FetchTokenizerRequest(content_hash=want), timeout=timeout_s, metadata=metadata
    )
    manifest: tokenizer_pb2.TokenizerManifest | None = None
    writer: _Writer | None = None
    try:
        async for chunk in call:
            if writer is None:
                if not chunk.HasField("manifest"):
                    raise FetchError("the stream did not start with a manifest")
                manifest = chunk.manifest
                _check_manifest(manifest, want)
                writer = _Writer(manifest, work)
            elif chunk.HasField("data"):
                writer.add(chunk.data)
            else:
                raise FetchError("a second manifest")
        if writer is None or manifest is None:
            raise FetchError("empty stream")
        writer.finish()
        return manifest
    except grpc.aio.AioRpcError as exc:
        details = (exc.details() or "")[:200]
        raise FetchError(f"Fetch failed: {exc.code().name} {details}".strip()) from None
    finally:
        if writer is not None:
            writer.close()
        call.cancel()
