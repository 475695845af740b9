"""Request migration's parts: which streams are migratable, the resumed leg's body, the
transcript read from decode's events, and the departures that move streams off decodes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pdplane.gateway.bodies import migratable, resumed_body, with_token_ids
from pdplane.gateway.departures import Departures
from pdplane.gateway.migration import Transcript, stop_lookback, stop_seam, whole_characters
from pdplane.gateway.seam import Seam, chat_logprobs, chat_top_logprobs
from pdplane.gateway.splice import FirstToken, Splice
from pdplane.gateway.validation import CHAT, COMPLETIONS
from pdplane.v1 import instance_pb2
from tests.unit.gateway.conftest import parsed


def test_which_streams_are_migratable() -> None:
    assert migratable(parsed(COMPLETIONS))
    assert migratable(parsed(CHAT, temperature=0, stop=[], seed=3))
    # vLLM holds back text that may start a stop string: only the tokenizer tells which
    assert not migratable(parsed(CHAT, stop=["x"]))
    assert not migratable(parsed(COMPLETIONS, stop="x", include_stop_str_in_output=True))
    assert migratable(parsed(CHAT, stop=["x"]), detokenizer=True)
    assert migratable(parsed(COMPLETIONS, stop="x", include_stop_str_in_output=True), True)
    assert migratable(parsed(COMPLETIONS, logprobs=2))  # completions logprobs continue
    assert not migratable(parsed(COMPLETIONS, stream=False))  # run again instead
    assert migratable(parsed(COMPLETIONS, n=2))  # each choice on its own leg
    assert not migratable(parsed(COMPLETIONS, echo=True))
    assert migratable(parsed(CHAT, logprobs=True, top_logprobs=2))  # continued as chat's
    assert not migratable(parsed(CHAT, tools=[{"type": "function"}]))
    assert not migratable(parsed(COMPLETIONS, return_token_ids=True))


def test_the_resumed_leg_asks_for_what_is_left_with_the_clients_sampling() -> None:
    req = parsed(CHAT, max_completion_tokens=20, min_tokens=8, temperature=0.5,
               stream_options={"include_usage": True}, seed=1)  # fmt: skip
    body = resumed_body(req, [1, 2, 3, 40, 41, 42], 3)
    assert body == {
        "prompt": [1, 2, 3, 40, 41, 42],
        "model": "m",
        "max_tokens": 17,
        "min_tokens": 5,
        "temperature": 0.5,
        "stream_options": {"include_usage": True},
        "seed": 1,
        "stream": True,
        "return_token_ids": True,
    }
    # chat without a limit: up to the model's length; min_tokens already met is dropped
    body = resumed_body(parsed(CHAT, min_tokens=2), [1, 2], 3)
    assert body["max_tokens"] is None and "min_tokens" not in body


def test_decode_legs_of_migratable_streams_ask_for_token_ids() -> None:
    raw = b'{"model":"m","prompt":"hi","stream":true}'
    body = json.loads(raw)
    assert json.loads(with_token_ids(raw, body, None)) == {**body, "return_token_ids": True}
    out = json.loads(with_token_ids(raw, body, b'{"t":1}'))
    assert out == {**body, "return_token_ids": True, "kv_transfer_params": {"t": 1}}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_the_transcript_reads_ids_and_strips_what_the_client_did_not_ask_for() -> None:
    t = Transcript()
    first = _event({"id": "cmpl-1", "created": 7, "model": "m", "choices": [
        {"index": 0, "text": " a", "finish_reason": None, "prompt_token_ids": [1, 2, 3],
         "token_ids": [10]}]})  # fmt: skip
    more = _event({"id": "cmpl-1", "choices": [
        {"index": 0, "text": " b c", "finish_reason": None, "prompt_token_ids": None,
         "token_ids": [11, 12]}]})  # fmt: skip
    t.observe(first + more)
    assert t.prompt_ids == [1, 2, 3] and t.sent == [10, 11, 12] and not t.finished
    assert (t.response_id, t.created, t.model) == ("cmpl-1", 7, "m")
    assert t.resumable() and t.resumed_prompt() == [1, 2, 3, 10, 11, 12]
    stripped = t.strip(first)
    assert b'"prompt_token_ids":null' in stripped and b'"token_ids":null' in stripped
    last = _event({"id": "cmpl-1", "choices": [
        {"index": 0, "text": " d", "finish_reason": "length", "token_ids": [13]}]})  # fmt: skip
    t.observe(last, resumed=True)
    assert t.sent == [10, 11, 12, 13] and t.finished


def test_a_resumed_legs_prompt_ids_are_not_the_clients() -> None:
    t = Transcript(FirstToken("cmpl-1", 1, "m", [1, 2], 9, " x", "length", None))
    assert t.prompt_ids == [1, 2] and t.sent == [9]
    t.observe(_event({"id": "cmpl-x", "choices": [
        {"text": " y", "finish_reason": None, "prompt_token_ids": [1, 2, 9],
         "token_ids": [8]}]}), resumed=True)  # fmt: skip
    assert t.prompt_ids == [1, 2] and t.sent == [9, 8] and t.response_id == "cmpl-1"


class _Stream:
    def __init__(self) -> None:
        self.evicted: list[str] = []

    def evict(self, reason: str) -> None:
        self.evicted.append(reason)


def _instance(instance_id: str, state: int) -> instance_pb2.Instance:
    inst = instance_pb2.Instance(state=state)
    inst.spec.instance_id = instance_id
    return inst


async def test_departures_move_streams_off_decodes_that_leave_or_drain() -> None:
    serving, draining = instance_pb2.INSTANCE_STATE_SERVING, instance_pb2.INSTANCE_STATE_DRAINING
    departures = Departures(grace_s=0.05)
    gone, drained, kept, finished = _Stream(), _Stream(), _Stream(), _Stream()
    departures.add("d1", gone)
    departures.add("d2", drained)
    departures.add("d2", finished)
    departures.add("d3", kept)
    departures.update({"d2": _instance("d2", draining), "d3": _instance("d3", serving)})
    assert gone.evicted == ["deregistered"]  # at once
    assert drained.evicted == []  # within the grace
    departures.discard("d2", finished)  # finished on the draining decode in time
    await asyncio.sleep(0.15)
    assert drained.evicted == ["drain"] and finished.evicted == [] and kept.evicted == []
    assert departures.open_streams("d2") == 0 and departures.open_streams("d3") == 1


async def test_a_decode_serving_again_keeps_its_streams() -> None:
    departures = Departures(grace_s=0.05)
    stream = _Stream()
    departures.add("d1", stream)
    departures.update({"d1": _instance("d1", instance_pb2.INSTANCE_STATE_DRAINING)})
    departures.update({"d1": _instance("d1", instance_pb2.INSTANCE_STATE_SERVING)})
    await asyncio.sleep(0.15)
    assert stream.evicted == []
    departures.close()


def _bytes_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: each id is one byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_a_seam_inside_a_character_resumes_after_the_last_whole_one() -> None:
    prompt = list(b"say: ")
    euro = list("€".encode())  # 3 bytes, 3 tokens
    assert whole_characters(prompt, [*b"ab", *euro], _bytes_decode) == 5  # all whole
    assert whole_characters(prompt, [*b"ab", *euro[:2]], _bytes_decode) == 2  # held open
    assert whole_characters(prompt, [*b"ab", *euro[:1]], _bytes_decode) == 2
    assert whole_characters(prompt, euro[:2], _bytes_decode) == 0
    t = Transcript(FirstToken("cmpl-1", 1, "m", prompt, ord("a"), "a", None, None))
    t.sent += euro[:2]
    t.rewind(whole_characters(prompt, t.sent, _bytes_decode))
    assert t.resumed_prompt() == [*prompt, ord("a")]


def test_a_stream_with_stop_strings_resumes_before_the_text_held_back() -> None:
    assert stop_lookback({"stop": ["ab", "wxyz"]}) == 3 and stop_lookback({"stop": "q"}) == 0
    assert stop_lookback({}) is None and stop_lookback({"stop": []}) is None
    prompt = list(b"say: ")
    sent = list(b"hello world")
    # 3 characters held back ("rld"): resume after "hello wo", nothing to drop
    assert stop_seam(prompt, sent, 8, 3, _bytes_decode) == (8, 0)
    # included stop strings hold nothing back, but a stop string may start in the last 3
    # characters: they are generated again, and dropped from the new leg's text
    assert stop_seam(prompt, sent, 11, 3, _bytes_decode) == (8, 3)
    # a character still open at the seam is not text yet
    euro = list("€".encode())
    assert stop_seam(prompt, [*b"ab", *euro[:2]], 2, 0, _bytes_decode) == (2, 0)
    assert stop_seam(prompt, sent, 0, 30, _bytes_decode) == (0, 0)


def test_the_transcript_counts_the_characters_the_client_got() -> None:
    t = Transcript(lookback=2)
    t.deliver(_event({"choices": [{"index": 0, "delta": {"content": 'h\u00e9 "x"'}}]}))
    raw = '{"choices":[{"index":0,"text":"€!","prompt_text":null}]}'.encode()  # unescaped
    t.deliver(b"data: " + raw + b"\n\n")
    assert t.delivered == 8


def test_a_resumed_leg_drops_the_text_and_logprobs_the_client_has() -> None:
    req = parsed(COMPLETIONS, logprobs=1)
    first = FirstToken("cmpl-1", 1, "m", [1, 2], 9, "", None, None)
    splice = Splice(req, first, None, None, 5, Seam(overlap=4, repeated=2, text_offset=10))

    def chunk(text: str, tokens: list[str], offset: int = 0) -> bytes:
        logprobs = {"tokens": tokens, "token_logprobs": [-1.0], "text_offset": [offset]}
        return _event({"id": "cmpl-2", "choices": [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}]})  # fmt: skip

    out = splice.rewrite(chunk(" wo", [" wo"]) + chunk("rld", ["rld"], 3) + chunk(" x", [" x"], 6))
    choices = [json.loads(e[6:])["choices"][0] for e in out.split(b"\n\n") if e]
    assert [c["text"] for c in choices] == ["", "ld", " x"]
    assert [c["logprobs"]["tokens"] for c in choices] == [[], [], [" x"]]
    assert choices[2]["logprobs"]["text_offset"] == [16]  # counted from the answer's start
    assert b'"text_offset":[18]' in splice.rewrite(chunk(" y", [" y"], 8))


def test_chat_logprobs_are_built_from_the_completions_legs() -> None:
    completions = {
        "tokens": [" é", " b"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{" é": -0.5, " a": -1.0}, {" b": -0.25, " c": -2.0}],
        "text_offset": [0, 2],
    }
    assert chat_logprobs(completions, 1) == {
        "content": [
            {"token": " é", "logprob": -0.5, "bytes": [32, 195, 169],
             "top_logprobs": [{"token": " é", "logprob": -0.5, "bytes": [32, 195, 169]}]},
            {"token": " b", "logprob": -0.25, "bytes": [32, 98],
             "top_logprobs": [{"token": " b", "logprob": -0.25, "bytes": [32, 98]}]},
        ]
    }  # fmt: skip
    assert chat_logprobs(completions, 0)["content"][0]["top_logprobs"] == []
    assert chat_top_logprobs({"logprobs": True}) == 0
    assert chat_top_logprobs({"logprobs": False, "top_logprobs": 2}) is None
    body = resumed_body(parsed(CHAT, logprobs=True, top_logprobs=3), [1, 2], 1)
    assert body["logprobs"] == 3 and "top_logprobs" not in body
    assert "logprobs" not in resumed_body(parsed(CHAT, logprobs=False), [1, 2], 1)


def test_the_transcript_follows_text_offset_as_vllm_advances_it() -> None:
    t = Transcript(text_offsets=True)
    assert t.reads_text and not Transcript().reads_text
    for offset, token in ((0, " ab"), (3, " c"), (5, " def")):
        logprobs = {"text_offset": [offset], "tokens": [token], "token_logprobs": [-1.0]}
        t.deliver(_event({"choices": [{"index": 0, "text": "", "logprobs": logprobs}]}))
    assert t.offsets == [0, 3, 5] and t.next_offset == 9  # by the tokens, not the text sent
    t.rewind(1)
    assert t.next_offset == 3 and t.offsets == [0]


def test_a_choice_of_n_above_1_resumes_alone_with_its_own_seed() -> None:
    req = parsed(COMPLETIONS, n=3, max_tokens=20, seed=7)
    body = resumed_body(req, [1, 2, 3, 40, 41], 2, choice=2)
    assert "n" not in body and body["max_tokens"] == 18 and body["seed"] == 9
    assert resumed_body(parsed(COMPLETIONS, n=3), [1, 2], 0, choice=1).get("seed") is None
