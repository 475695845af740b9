"""What the connector publishes of its tokenizer, read from vLLM's config and the server's
command line (with vLLM's own argument parser)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from pdplane.connector.tokenizer import published_tokenizer, server_chat_options
from pdplane.core.tokenizer.bundle import TokenizerBundle, collect


def test_the_command_line_gives_the_served_chat_template_and_kwargs(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    kwargs = '{"enable_thinking": false}'
    serve = ["vllm", "serve", "/models/m", "--chat-template", str(template)]
    assert server_chat_options(serve) == (template.read_text(), "")
    # The deprecated module form, a literal template, `=` and vLLM's underscore spelling.
    module = ["/x/vllm/entrypoints/openai/api_server.py", "--model", "/models/m"]
    assert server_chat_options([*module, "--chat_template={{ 'x' }}"]) == ("{{ 'x' }}", "")
    got = server_chat_options([*module, "--default-chat-template-kwargs", kwargs])
    assert got == ("", json.dumps({"enable_thinking": False}))
    assert server_chat_options([*serve[:3], "--max-model-len", "1024"]) == ("", "")


def _config(tokenizer: str, **model: object) -> SimpleNamespace:
    fields = {"tokenizer": tokenizer, "model": tokenizer, "tokenizer_mode": "auto", **model}
    return SimpleNamespace(model_config=SimpleNamespace(**fields))


def test_the_loaded_tokenizer_is_published_or_why_not(tiny_model: Path) -> None:
    published = published_tokenizer(_config(str(tiny_model)))
    assert isinstance(published, TokenizerBundle)
    assert published.content_hash == collect(tiny_model).content_hash
    assert "skip-tokenizer-init" in str(
        published_tokenizer(_config(str(tiny_model), skip_tokenizer_init=True))
    )
    assert "mode 'mistral'" in str(
        published_tokenizer(_config(str(tiny_model), tokenizer_mode="mistral"))
    )
    missing = published_tokenizer(_config("no-such-org/no-such-model"))
    assert isinstance(missing, str) and "Hugging Face cache" in missing
