"""The sim's Hugging Face tokenizer gives integer ids for chat, as vLLM's chat template does."""

from __future__ import annotations

import os
from pathlib import Path

from pdplane.models.tiny import build_tiny_model
from pdplane.sim.tokens import HfTokenizer


def test_chat_ids_are_the_templates_integer_ids() -> None:
    cache = Path(os.environ.get("PDPLANE_MODEL_CACHE", Path.home() / ".cache/pdplane/models"))
    tok = HfTokenizer(str(build_tiny_model(cache)))
    messages = [{"role": "user", "content": "hello there, how are you today?"}]
    ids = tok.encode_chat(messages)
    # transformers' BatchEncoding is no dict: listing it gave its keys ("input_ids", ...).
    assert ids and all(isinstance(i, int) for i in ids)
    assert len(ids) > len(tok.encode("hello there, how are you today?"))
