"""The sim's logprobs: vLLM's completions and chat shapes, values that depend on the token
only, and vLLM's 400s for what it refuses."""

from __future__ import annotations

from pdplane.sim.logprobs import Logprobs, parse_logprobs
from pdplane.sim.tokens import WordTokenizer


def test_completions_and_chat_shapes() -> None:
    tok = WordTokenizer()
    ids, pieces = tok.sample("k", 0, 2)
    out = Logprobs(chat=False, top=2).of(tok, ids, pieces, 5)
    assert out["tokens"] == pieces
    assert out["text_offset"] == [5, 5 + len(pieces[0])]
    assert [next(iter(t)) for t in out["top_logprobs"]] == pieces  # the sampled token first
    assert all(len(t) == 2 for t in out["top_logprobs"])
    assert out["token_logprobs"] == [t[p] for t, p in zip(out["top_logprobs"], pieces, strict=True)]
    chat = Logprobs(chat=True, top=1).of(tok, ids, pieces, 0)["content"]
    assert [c["token"] for c in chat] == pieces
    assert [c["logprob"] for c in chat] == out["token_logprobs"]
    assert chat[0]["bytes"] == list(pieces[0].encode())
    assert [len(c["top_logprobs"]) for c in chat] == [1, 1]
    assert Logprobs(chat=True, top=0).of(tok, ids, pieces, 0)["content"][0]["top_logprobs"] == []
    assert len(Logprobs(chat=False, top=0).of(tok, ids, pieces, 0)["top_logprobs"][0]) == 1
    # a token's logprobs are the same wherever it is generated
    assert (
        Logprobs(chat=False, top=2).of(tok, ids[1:], pieces[1:], 0)["top_logprobs"]
        == (out["top_logprobs"][1:])
    )


def test_parse_logprobs() -> None:
    assert parse_logprobs({}, chat=False) is None and parse_logprobs({}, chat=True) is None
    assert parse_logprobs({"logprobs": 0}, chat=False) == Logprobs(False, 0)
    assert parse_logprobs({"logprobs": True, "top_logprobs": 3}, True) == Logprobs(True, 3)
    assert parse_logprobs({"logprobs": False}, chat=True) is None
    assert "must be set to true" in str(parse_logprobs({"top_logprobs": 2}, chat=True))
    assert "greater than max allowed: 20" in str(parse_logprobs({"logprobs": 21}, False))
