"""A tiny Llama model + byte-level BPE tokenizer (with a chat template), built locally.

Used by `pdplane up`, the end-to-end tests and the docker image to run real vLLM instances
without downloading weights. The build is deterministic (fixed seed, fixed corpus) and cached:
the model lands in `dest_dir/tiny-llama-<hash>/`, where the hash covers the whole recipe, so a
second call returns at once and a changed recipe builds a fresh directory.

Shape: 2 layers, hidden 128, 4 attention heads, 2 KV heads (head size 32), vocab 2048, float32
weights (~3 MB). Outputs are meaningless but greedy decoding is deterministic.

    python -m pdplane.models.tiny DIR      # prints the model path
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["MODEL_CONFIG", "build_tiny_model"]

_RECIPE_VERSION = 1

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORD_TEXT = (
    "the a an of to in and for on with by from at as is are was be it this that these those "
    "prefill decode cache block token layer head model request response server client gateway "
    "registry scheduler lease heartbeat transfer latency throughput batch queue stream tensor "
    "alpha beta gamma delta river mountain forest ocean city village garden window door table "
    "red green blue yellow black white small large quick slow bright dark warm cold new old "
    "one two three four five six seven eight nine ten hundred thousand first second last next "
    "run walk read write send receive build start stop open close move keep hold free pull push"
)
_WORDS = _WORD_TEXT.split()


def _corpus() -> list[str]:
    # Deterministic pseudo-text: every word, word pairs and numbers, so BPE learns merges.
    lines = [" ".join(_WORDS)]
    for i, w in enumerate(_WORDS):
        nxt = _WORDS[(i * 7 + 3) % len(_WORDS)]
        lines.append(f"{w} {nxt} {i} {w.capitalize()}, {nxt}. {i * 13 % 97}")
    lines.extend(f"{a} {b}" for a in _WORDS[:40] for b in _WORDS[40:80])
    return lines


def _recipe_hash() -> str:
    recipe = {
        "version": _RECIPE_VERSION,
        "config": MODEL_CONFIG,
        "special": _SPECIAL_TOKENS,
        "template": _CHAT_TEMPLATE,
        "corpus": _corpus(),
        "seed": 0,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL_CONFIG["vocab_size"],
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=_CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        **MODEL_CONFIG,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_model(dest_dir: Path) -> Path:
    """Builds (or reuses) the tiny model under `dest_dir`; returns its directory.

    The directory holds `config.json`, `model.safetensors` and the tokenizer files, loadable by
    `vllm --model DIR` and transformers. Safe against concurrent builders (build in a temporary
    directory, then an atomic rename). Raises whatever transformers/tokenizers raise on failure.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / f"tiny-llama-{_recipe_hash()}"
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=dest_dir))
    tmp.chmod(0o755)  # readable by other users (e.g. a container running vLLM as non-root)
    try:
        _build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another builder won the race; its result is identical.
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m pdplane.models.tiny DIR\n")
        return 2
    print(build_tiny_model(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
