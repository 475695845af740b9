"""What an instance publishes of its tokenizer: which files, one content hash, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdplane.core.tokenizer.bundle import (
    CHUNK_BYTES,
    TokenizerUnpublishable,
    collect,
    content_hash,
    valid_hash,
)


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    return out


def test_the_tokenizer_files_are_published_and_the_weights_are_not(tiny_model: Path) -> None:
    bundle = collect(tiny_model)
    names = [f.name for f in bundle.files]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    assert "model.safetensors" not in names and "generation_config.json" not in names
    assert valid_hash(bundle.content_hash)
    assert bundle.content_hash == content_hash(bundle.manifest())
    assert bundle.total_bytes == sum((tiny_model / n).stat().st_size for n in names)


def test_python_files_are_never_published(model_copy: Path) -> None:
    (model_copy / "tokenization_custom.py").write_text("import os\n")
    (model_copy / "additional_chat_templates").mkdir()
    (model_copy / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 1 }}")
    (model_copy / "additional_chat_templates" / "evil.py").write_text("import os\n")
    names = [f.name for f in collect(model_copy).files]
    assert "additional_chat_templates/tool_use.jinja" in names
    assert not [n for n in names if n.endswith(".py")]


def test_the_hash_follows_every_input_that_changes_token_ids(
    tiny_model: Path, model_copy: Path
) -> None:
    base = collect(tiny_model).content_hash
    assert collect(tiny_model).content_hash == base  # deterministic
    assert collect(model_copy).content_hash == base  # the content, not the path
    assert collect(tiny_model, chat_template="{{ 'x' }}").content_hash != base
    assert collect(tiny_model, default_chat_template_kwargs='{"a": 1}').content_hash != base
    assert collect(tiny_model, tokenizer_mode="slow").content_hash != base
    template = model_copy / "chat_template.jinja"
    template.write_text(template.read_text() + " ")
    assert collect(model_copy).content_hash != base


def test_tokenizers_a_gateway_cannot_reproduce_are_refused_with_why(
    model_copy: Path, tmp_path: Path
) -> None:
    with pytest.raises(TokenizerUnpublishable, match="mode 'mistral'"):
        collect(model_copy, tokenizer_mode="mistral")
    with pytest.raises(TokenizerUnpublishable, match="does not exist"):
        collect(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerUnpublishable, match="no tokenizer files"):
        collect(tmp_path / "empty")
    with pytest.raises(TokenizerUnpublishable, match="JSON object"):
        collect(model_copy, default_chat_template_kwargs="[1]")
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerUnpublishable, match="trust_remote_code"):
        collect(model_copy)


def test_the_stream_is_the_manifest_then_every_file_in_bounded_chunks(model_copy: Path) -> None:
    (model_copy / "vocab.txt").write_bytes(bytes(range(256)) * (CHUNK_BYTES // 256 + 10))
    bundle = collect(model_copy)
    chunks = list(bundle.chunks())
    assert chunks[0].HasField("manifest") and chunks[0].manifest == bundle.manifest()
    got: dict[str, bytes] = {}
    for chunk in chunks[1:]:
        assert chunk.HasField("data") and len(chunk.data.data) <= CHUNK_BYTES
        assert chunk.data.offset == len(got.get(chunk.data.name, b""))
        got[chunk.data.name] = got.get(chunk.data.name, b"") + chunk.data.data
    assert got == {f.name: (model_copy / f.name).read_bytes() for f in bundle.files}
    assert [n for n in dict.fromkeys(c.data.name for c in chunks[1:])] == [
        f.name for f in bundle.files
    ]


def test_valid_hash() -> None:
    assert valid_hash("sha256:" + "0" * 64)
    for bad in ("", "sha256:" + "0" * 63, "sha256:" + "G" * 64, "md5:" + "0" * 64):
        assert not valid_hash(bad)
