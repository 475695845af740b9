"""Profiles and configs (named, from JSON, overridable) and the deterministic tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdplane.sim.config import SimConfig
from pdplane.sim.profiles import PROFILES, Profile, load_profile
from pdplane.sim.settings import SimSettings
from pdplane.sim.tokens import (
    VOCAB,
    WordTokenizer,
    chat_prompt_tokens,
    continuation,
    generate,
    prompt_key,
)


def test_every_profile_names_its_sources_and_fits_its_context() -> None:
    for name, profile in PROFILES.items():
        assert profile.name == name
        if name != "zero":
            assert profile.sources, name
        config = SimConfig.from_profile(name)  # validates max_model_len against the cache
        assert config.cost_model() == profile.cost


def test_llama3_on_h200_is_faster_per_decode_step_than_on_h100() -> None:
    h100, h200 = PROFILES["llama3-8b-h100"].cost, PROFILES["llama3-8b-h200"].cost
    assert h200.step_time_ms(64, 0, 64, 64_000, 0) < h100.step_time_ms(64, 0, 64, 64_000, 0)
    # compute-bound prefill is the same chip generation's FLOPs
    assert h200.token_ms == h100.token_ms
    assert PROFILES["llama3-8b-h100"].kv_bytes_per_token == 131072


def test_a_profile_round_trips_through_json_and_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(PROFILES["tiny-cpu"].to_dict()))
    assert load_profile(str(path)) == PROFILES["tiny-cpu"]
    config = SimConfig.from_profile(str(path), kv_blocks=1024)
    assert config.kv_blocks == 1024 and config.block_size == 128
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-profile")
    with pytest.raises(ValueError, match="unknown profile fields"):
        Profile.from_dict({**PROFILES["zero"].to_dict(), "typo": 1})


def test_settings_take_the_profile_unless_a_flag_says_otherwise() -> None:
    config = SimSettings.parse(["--profile", "llama3-8b-h100", "--kv-blocks", "5000"]).sim_config()
    assert config.kv_blocks == 5000
    assert config.max_num_seqs == 1024 and config.num_layers == 32
    assert config.cost_model() == PROFILES["llama3-8b-h100"].cost
    plain = SimSettings.parse(["--itl-ms", "10"]).sim_config()
    assert plain.cost_model().weights_ms == 10 and plain.kv_blocks == 8192


def test_a_context_the_cache_cannot_hold_is_refused_like_vllm() -> None:
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        SimConfig(kv_blocks=4, block_size=16, max_model_len=1000)


def test_transfer_time_counts_latency_bytes_and_tokens() -> None:
    c = SimConfig(transfer_gbps=1.0, transfer_latency_ms=2.0, kv_transfer_ms_per_token=0.001)
    # tiny layout: 2 x 2 layers x 2 heads x 32 x 4 bytes = 1024 bytes per token
    assert c.transfer_s(1000) == pytest.approx((2.0 + 1.0 + 1024e3 / 1e9 * 1e3) / 1e3)


def test_word_tokenizer_counts_like_before_and_is_stable() -> None:
    tok = WordTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = tok.encode_chat(messages)
    assert len(ids) == chat_prompt_tokens(messages)
    assert ids == WordTokenizer().encode_chat(messages)  # a fresh instance, same ids
    assert tok.encode("") == tok.encode("   ") and len(tok.encode("")) == 1


def test_a_generated_answer_sent_back_continues_the_same_token_sequence() -> None:
    tok = WordTokenizer()
    turn1 = [{"role": "user", "content": "tell me"}]
    prompt1 = tok.encode_chat(turn1)
    out_ids, pieces = tok.sample("key", 0, 12)
    assert pieces == generate("key", 0, 12)
    assert all(p in VOCAB for p in pieces)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "".join(pieces)},
        {"role": "user", "content": "more"},
    ]
    assert tok.encode_chat(turn2)[: len(prompt1) + 12] == prompt1 + out_ids


def test_continuation_is_the_answer_after_prefills_first_token() -> None:
    tok = WordTokenizer()
    prompt = tok.encode("one two three")
    ids, pieces = tok.sample(prompt_key(prompt), 0, 5)
    assert continuation(tok, [*prompt, ids[0]], len(prompt), 0, 4) == (ids[1:], pieces[1:])
    # Not prefill's first token, or not exactly one token more: an ordinary prompt.
    assert continuation(tok, [*prompt, ids[0] + 1], len(prompt), 0, 4) is None
    assert continuation(tok, [*prompt, ids[0]], len(prompt) - 1, 0, 4) is None
    assert continuation(tok, prompt, len(prompt), 0, 4) is None
