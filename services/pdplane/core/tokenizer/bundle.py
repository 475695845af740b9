"""A tokenizer as an instance publishes it: its files, chat template and one content hash.

An instance (the connector inside vLLM, or `pdplane sim --tokenizer DIR`) publishes the
tokenizer it serves its model with, so that a gateway reproduces the prompt token ids the
engine computes without being told where the model lives (`pdplane.v1.TokenizerFiles`). The
bundle is data only: the files a Hugging Face tokenizer loads from (`tokenizer.json`, its
configs, vocabularies, SentencePiece models, chat template files, `config.json` for the
tokenizer class) and never Python code. A tokenizer that needs `trust_remote_code` (its
`tokenizer_config.json` maps `AutoTokenizer` to code of the model's own) is not published:
a gateway that trusts that code is given the model folder with `--tokenizer` instead.

The content hash covers every file's bytes (SHA-256), the chat template override, the default
chat template kwargs and the tokenizer mode, so two instances with the same hash give the
same token ids for the same request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdplane.v1 import tokenizer_pb2

__all__ = [
    "CHUNK_BYTES",
    "MAX_BUNDLE_BYTES",
    "TokenizerBundle",
    "TokenizerUnpublishable",
    "collect",
    "content_hash",
    "valid_hash",
]

#: Bytes of file data per `TokenizerFileData` message (gRPC's default limit is 4 MiB).
CHUNK_BYTES = 1 << 20
#: Largest bundle published (bytes over all files): real tokenizers are 2-20 MB.
MAX_BUNDLE_BYTES = 64 << 20

#: Files a Hugging Face tokenizer is loaded from (transformers' `*_FILES_NAMES` of the fast and
#: slow tokenizers in use, plus the chat template files and the model config that names the
#: tokenizer class when `tokenizer_config.json` does not).
_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)
_TEMPLATE_DIR = "additional_chat_templates"
_MODES = ("auto", "hf", "slow")
_HASH_PREFIX = "sha256:"


class TokenizerUnpublishable(Exception):
    """This tokenizer cannot be published; the message says why (one line)."""


@dataclass(frozen=True, slots=True)
class _File:
    name: str  # relative, "/"-separated
    path: Path
    size: int  # bytes
    sha256: str  # hex


def valid_hash(value: str) -> bool:
    """Whether `value` is a content hash as published: "sha256:" + 64 lowercase hex digits."""
    digest = value.removeprefix(_HASH_PREFIX)
    return (
        len(value) == len(_HASH_PREFIX) + 64
        and value.startswith(_HASH_PREFIX)
        and all(c in "0123456789abcdef" for c in digest)
    )


def content_hash(manifest: tokenizer_pb2.TokenizerManifest) -> str:
    """The content hash of `manifest` (its `content_hash` field ignored): SHA-256 over the mode,
    the chat template, the default kwargs and each file's name and SHA-256, sorted by name,
    each field length-prefixed; "sha256:<hex>"."""
    h = hashlib.sha256(b"pdplane-tokenizer-v1")
    fields = [
        manifest.tokenizer_mode,
        manifest.chat_template,
        manifest.default_chat_template_kwargs,
    ]
    for f in sorted(manifest.files, key=lambda f: f.name):
        fields += [f.name, f.sha256]
    for text in fields:
        data = text.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return _HASH_PREFIX + h.hexdigest()


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _candidates(directory: Path) -> list[tuple[str, Path]]:
    found = [(name, directory / name) for name in _FILES if (directory / name).is_file()]
    extra = directory / _TEMPLATE_DIR
    if extra.is_dir():
        found += [
            (f"{_TEMPLATE_DIR}/{p.name}", p) for p in sorted(extra.glob("*.jinja")) if p.is_file()
        ]
    return found


def _needs_remote_code(directory: Path) -> bool:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    return isinstance(auto_map, dict) and "AutoTokenizer" in auto_map


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    """A publishable tokenizer (build it with `collect`)."""

    directory: Path
    files: tuple[_File, ...]
    chat_template: str
    default_chat_template_kwargs: str
    tokenizer_mode: str
    content_hash: str

    @property
    def total_bytes(self) -> int:
        """Bytes over all files."""
        return sum(f.size for f in self.files)

    def manifest(self) -> tokenizer_pb2.TokenizerManifest:
        """The manifest message, content hash included."""
        return tokenizer_pb2.TokenizerManifest(
            content_hash=self.content_hash,
            files=[
                tokenizer_pb2.TokenizerFile(name=f.name, size=f.size, sha256=f.sha256)
                for f in self.files
            ],
            chat_template=self.chat_template,
            default_chat_template_kwargs=self.default_chat_template_kwargs,
            tokenizer_mode=self.tokenizer_mode,
            total_bytes=self.total_bytes,
        )

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tokenizer_pb2.TokenizerChunk]:
        """The `Fetch` stream: the manifest, then every file's bytes in manifest order, at most
        `chunk_bytes` per message, read from disk as they are sent (a file changed since
        `collect` fails the receiver's SHA-256 check, never this stream).

        Raises OSError when a file can no longer be read."""
        yield tokenizer_pb2.TokenizerChunk(manifest=self.manifest())
        for f in self.files:
            with f.path.open("rb") as src:
                offset = 0
                while data := src.read(chunk_bytes):
                    yield tokenizer_pb2.TokenizerChunk(
                        data=tokenizer_pb2.TokenizerFileData(name=f.name, offset=offset, data=data)
                    )
                    offset += len(data)


def collect(
    directory: str | Path,
    *,
    chat_template: str = "",
    default_chat_template_kwargs: str = "",
    tokenizer_mode: str = "auto",
) -> TokenizerBundle:
    """The bundle of the tokenizer in `directory` (a model folder or a tokenizer folder).

    Args:
        directory: where the tokenizer files are.
        chat_template: the served chat template when it overrides the tokenizer's own (Jinja
            text, not a path); "" = the tokenizer's own.
        default_chat_template_kwargs: the server's default chat template kwargs (a JSON object
            as text); "" = none.
        tokenizer_mode: vLLM's tokenizer mode ("auto", "hf" or "slow").

    Raises:
        TokenizerUnpublishable: no tokenizer files there, a mode or tokenizer a gateway cannot
            reproduce (e.g. "mistral", `trust_remote_code`), kwargs that are not a JSON
            object, or more than MAX_BUNDLE_BYTES of files.
    """
    root = Path(directory)
    if tokenizer_mode not in _MODES:
        raise TokenizerUnpublishable(
            f"tokenizer mode {tokenizer_mode!r} is not reproduced by the gateway (only "
            f"{', '.join(_MODES)})"
        )
    if not root.is_dir():
        raise TokenizerUnpublishable(f"tokenizer directory {str(root)!r} does not exist")
    candidates = _candidates(root)
    names = {name for name, _ in candidates}
    if not names & {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"}:
        raise TokenizerUnpublishable(f"no tokenizer files in {str(root)!r}")
    if _needs_remote_code(root):
        raise TokenizerUnpublishable(
            "the tokenizer needs trust_remote_code (tokenizer_config.json maps AutoTokenizer "
            "to the model's own code), which pdplane never runs from the network: give the "
            "gateway the model folder with --tokenizer"
        )
    if default_chat_template_kwargs:
        try:
            kwargs = json.loads(default_chat_template_kwargs)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise TokenizerUnpublishable("default chat template kwargs are not a JSON object")
    files = []
    for name, path in candidates:
        size, sha = _digest(path)
        files.append(_File(name, path, size, sha))
    total = sum(f.size for f in files)
    if total > MAX_BUNDLE_BYTES:
        raise TokenizerUnpublishable(
            f"tokenizer files of {total} bytes exceed the {MAX_BUNDLE_BYTES} bytes published"
        )
    bundle = TokenizerBundle(
        directory=root,
        files=tuple(files),
        chat_template=chat_template,
        default_chat_template_kwargs=default_chat_template_kwargs,
        tokenizer_mode=tokenizer_mode,
        content_hash="",
    )
    return dataclasses.replace(bundle, content_hash=content_hash(bundle.manifest()))
