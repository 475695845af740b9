"""The first token from prefill: which requests take it, what decode is sent, and how decode's
chunks are rewritten into the client's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdplane.gateway.bodies import continuation_body, takes_first_token
from pdplane.gateway.splice import FirstToken, Splice, splice_for
from pdplane.gateway.validation import CHAT, COMPLETIONS, Endpoint
from tests.unit.gateway.conftest import parsed

KV = b'{"pdplane_transfer_id":"t"}'


def _first(endpoint: Endpoint = COMPLETIONS, **kw: Any) -> FirstToken:
    fields: dict[str, Any] = {
        "response_id": "cmpl-r1" if endpoint == COMPLETIONS else "chatcmpl-r1",
        "created": 100,
        "model": "m",
        "prompt_token_ids": [5, 6, 7],
        "token_id": 42,
        "text": " Hello",
        "finish_reason": "length",
        "stop_reason": None,
    }
    fields.update(kw)
    return FirstToken(**fields)


def _events(data: bytes) -> list[Any]:
    out: list[Any] = []
    for event in data.split(b"\n\n"):
        if event:
            payload = event.removeprefix(b"data: ")
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_plain_streamed_requests_apply(endpoint: Endpoint) -> None:
    assert takes_first_token(
        parsed(endpoint, max_tokens=8, temperature=0.7, top_p=0.9, ignore_eos=True)
    )
    assert takes_first_token(parsed(endpoint, stream_options={"include_usage": True}, n=1, stop=[]))


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": False},
        {"seed": 3},
        {"seed": 0},  # a seed like any other
        {"logprobs": 0},  # completions: the sampled tokens' logprobs
        {"echo": 1},
        {"stop": ["\n"]},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.1},
        {"min_tokens": 2},
        {"n": 2},
        {"echo": True},
        {"response_format": {"type": "json_object"}},
        {"some_new_vllm_field": 1},  # unknown to the gateway: the usual path
    ],
)
def test_requests_that_would_sample_differently_when_split_do_not_apply(
    extra: dict[str, Any],
) -> None:
    assert not takes_first_token(parsed(COMPLETIONS, **extra))


def test_neutral_values_of_the_checked_fields_apply() -> None:
    neutral = {"stop": [], "presence_penalty": 0.0, "frequency_penalty": 0, "min_tokens": 0}
    assert takes_first_token(parsed(COMPLETIONS, seed=None, logprobs=None, echo=False, **neutral))


def test_chat_with_tools_or_logprobs_does_not_apply() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert not takes_first_token(parsed(CHAT, tools=tools))
    assert not takes_first_token(parsed(CHAT, logprobs=True))
    assert takes_first_token(parsed(CHAT, logprobs=False))


def test_prefills_answer_gives_the_first_token_or_none_without_token_ids() -> None:
    answer = {
        "id": "cmpl-r1",
        "created": 100,
        "model": "m",
        "choices": [
            {"text": " Hello", "finish_reason": "length", "stop_reason": None,
             "prompt_token_ids": [5, 6, 7], "token_ids": [42]}
        ],
    }  # fmt: skip
    assert FirstToken.of(COMPLETIONS, answer) == _first()
    chat = {**answer, "id": "chatcmpl-r1", "prompt_token_ids": [5, 6, 7]}
    message = {"role": "assistant", "content": " Hello"}
    chat["choices"] = [
        {"message": message, "finish_reason": "length", "stop_reason": None, "token_ids": [42]}
    ]
    assert FirstToken.of(CHAT, chat) == _first(CHAT)
    older = {**answer, "choices": [{**answer["choices"][0], "token_ids": None}]}
    assert FirstToken.of(COMPLETIONS, older) is None  # an older vLLM: the usual path
    partial = {**answer, "choices": [{**answer["choices"][0], "text": "\ufffd"}]}
    assert FirstToken.of(COMPLETIONS, partial) is None  # half a character
    # vLLM's detokenizer, after a prompt whose text ends with U+FFFD (random-token prompts),
    # writes the prompt's pending text with the first token: U+FFFD inside, a whole token at
    # the end. One instance streams that text as its first token: so does the gateway.
    pending = "\ufffd\ufffd\x7f\ufffd\ufffd<x2591>"
    junk = {**answer, "choices": [{**answer["choices"][0], "text": pending}]}
    first = FirstToken.of(COMPLETIONS, junk)
    assert first is not None and first.text == pending


def _byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["hello there, hello again"], trainer=trainer)
    return tok


def test_a_first_token_that_starts_a_character_is_held_until_the_character_ends() -> None:
    # vLLM's detokenizer holds back a token that ends inside a UTF-8 character: prefill's
    # text is "". Decode's detokenizer, primed with a prompt that ends inside that
    # character (`DecodeStream(ids=prompt)`, as vLLM 0.32 does), would emit the prompt's
    # text again with the character: the character's text is rebuilt from token ids.
    from tokenizers.decoders import DecodeStream

    tok = _byte_level_tokenizer()
    prompt, emoji = tok.encode("hello ").ids, tok.encode("\U0001f600").ids
    assert len(emoji) > 1
    single = DecodeStream(ids=prompt, skip_special_tokens=True)
    assert [single.step(tok, t) for t in emoji][-1] == "\U0001f600"
    assert DecodeStream(ids=prompt).step(tok, emoji[0]) is None  # prefill's text: ""
    split = DecodeStream(ids=[*prompt, emoji[0]], skip_special_tokens=True)
    assert [split.step(tok, t) for t in emoji[1:]][-1] != "\U0001f600"

    answer = {
        "id": "cmpl-r1",
        "choices": [{"text": "", "finish_reason": "length", "stop_reason": None,
                     "prompt_token_ids": prompt, "token_ids": emoji[:1]}],
    }  # fmt: skip
    first = FirstToken.of(COMPLETIONS, answer)
    assert first is not None

    def decode(ids: list[int]) -> str:
        text: str = tok.decode(ids, skip_special_tokens=False)
        return text

    assert first.continuable(decode) and first.inside_character(decode)
    assert not first.continuable(None)  # no tokenizer: no text is taken as that
    assert not first.inside_character(None)
    assert not _first().inside_character(decode)  # a token with text of its own
    # a first token that ends the request (EOS, skipped) needs no continuation
    ending = {**answer, "choices": [{**answer["choices"][0], "finish_reason": "stop"}]}
    stop = FirstToken.of(COMPLETIONS, ending)
    assert stop is not None and stop.continuable(None)


def test_a_textless_first_token_after_a_prompt_inside_a_character_takes_the_usual_path() -> None:
    # Token-id prompts may end inside a character: one instance's detokenizer then emits the
    # prompt's bytes with the character's end, which decode's, primed further on, would not.
    tok = _byte_level_tokenizer()
    emoji = tok.encode("\U0001f600").ids
    prompt = [*tok.encode("hello ").ids, emoji[0]]

    def decode(ids: list[int]) -> str:
        text: str = tok.decode(ids, skip_special_tokens=False)
        return text

    first = _first(prompt_token_ids=prompt, token_id=emoji[1], text="")
    assert not first.continuable(decode)
    assert _first(prompt_token_ids=prompt, text="x").continuable(decode)  # text of its own


def _decode_stream(prompt: list[int], out: list[int], per_chunk: int = 1) -> bytes:
    """What vLLM's decode streams for `out` after `prompt` (`return_token_ids`): its
    detokenizer primed with the whole prompt, as vLLM 0.32's is; `per_chunk` tokens a chunk
    (vLLM's API server merges the outputs of engine steps it has not sent yet)."""
    from tokenizers.decoders import DecodeStream

    tok = _byte_level_tokenizer()
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    events = []
    for i in range(0, len(out), per_chunk):
        ids = out[i : i + per_chunk]
        text = "".join(stream.step(tok, t) or "" for t in ids)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": None, "stop_reason": None,
                                  "token_ids": ids}  # fmt: skip
        if i == 0:
            choice["prompt_token_ids"] = prompt
        if i + per_chunk >= len(out):
            choice["finish_reason"] = "length"
        obj = {"id": "cmpl-d", "object": "text_completion", "created": 1, "model": "m",
               "choices": [choice], "usage": None}  # fmt: skip
        events.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


#: A lead byte, a letter (the lead byte is invalid then: "\ufffdt"), two more lead bytes.
_INVALID = ["\u00c3", "t", "\u00cc", "\u00cc"]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("per_chunk", [1, 2, 3])
@pytest.mark.parametrize(
    "whole", ["\U0001f600 hello", "\u00e9\u00e9 there", "\U0001f600", "invalid"]
)
def test_a_held_character_streams_as_one_instance_streams_it(
    endpoint: Endpoint, per_chunk: int, whole: str
) -> None:
    from tokenizers.decoders import DecodeStream

    tok = _byte_level_tokenizer()
    prompt = tok.encode("hello ").ids
    # "invalid": byte-level tokens by their symbols
    out = [tok.token_to_id(t) for t in _INVALID] if whole == "invalid" else tok.encode(whole).ids
    single = DecodeStream(ids=prompt, skip_special_tokens=True)
    steps = [single.step(tok, t) or "" for t in out]
    assert steps[0] == ""  # the first token ends inside a character
    # the first token's chunk, then decode's chunks of `per_chunk` tokens
    rest = steps[1:]
    expected = [""] + ["".join(rest[i : i + per_chunk]) for i in range(0, len(rest), per_chunk)]

    def decode(ids: list[int]) -> str:
        text: str = tok.decode(ids, skip_special_tokens=False)
        return text

    first = _first(endpoint, prompt_token_ids=prompt, token_id=out[0], text="")
    assert first.inside_character(decode)
    splice = Splice(parsed(endpoint), first, decode)
    assert splice.token_ids
    body = continuation_body(parsed(endpoint), first.decode_prompt, KV, splice.token_ids)
    assert json.loads(body)["return_token_ids"] is True
    events = _events(splice.opening())
    decode_events = _decode_stream([*prompt, out[0]], out[1:], per_chunk)
    # one event at a time, or all at once: the same stream
    cut = decode_events.index(b"\n\n") + 2
    rewritten = splice.rewrite(decode_events[:cut]) + splice.rewrite(decode_events[cut:])
    events += _events(rewritten)
    texts = []
    for e in events:
        for c in e["choices"] if isinstance(e, dict) else ():
            texts.append(c["text"] if endpoint == COMPLETIONS else c["delta"]["content"])
            assert c.get("token_ids") is None and c.get("prompt_token_ids") is None
    if endpoint == CHAT:
        texts = texts[1:]  # the role chunk
    assert texts == expected
    assert b'token_ids":[' not in rewritten


def test_only_completions_chunks_carry_decodes_token_ids_through_the_splice() -> None:
    # A migratable stream's decode leg streams token ids the client did not ask for; the relay
    # takes them out only where the splice would pass them (`passes_token_ids`).
    ids = b'"prompt_token_ids":[5,6],"token_ids":[17]'
    decode = (
        b'data: {"id":"cmpl-d","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":" a","finish_reason":null,"stop_reason":null,' + ids + b"}]}\n\n"
        b'data: {"id":"cmpl-d","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":"!","finish_reason":"length","stop_reason":null,' + ids + b"}]}\n\n"
        b'data: {"id":"cmpl-d","object":"text_completion","created":1,"model":"m",'
        b'"choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3}}\n\n'
        b"data: [DONE]\n\n"
    )
    chat = Splice(parsed(CHAT, stream_options={"include_usage": True}), _first(CHAT))
    assert not chat.passes_token_ids
    assert b'token_ids":[' not in chat.rewrite(decode)
    completions = Splice(parsed(COMPLETIONS), _first())
    assert completions.passes_token_ids
    assert b'token_ids":[17]' in completions.rewrite(decode)


def test_decode_gets_no_token_ids_unless_a_character_is_held() -> None:
    assert "return_token_ids" not in json.loads(
        continuation_body(parsed(COMPLETIONS), _first().decode_prompt, KV)
    )
    assert not Splice(parsed(COMPLETIONS), _first()).token_ids


def test_a_first_token_that_decodes_to_nothing_is_continued_when_the_tokenizer_says_so() -> None:
    # An id past the tokenizer's vocabulary (a model padded to a round vocabulary size), or
    # a skipped special token: text "", but not part of a character.
    tok = _byte_level_tokenizer()
    prompt = tok.encode("hello ").ids
    padded = tok.get_vocab_size() + 5
    first = _first(prompt_token_ids=prompt, token_id=padded, text="")

    def decode(ids: list[int]) -> str:
        text: str = tok.decode(ids, skip_special_tokens=False)
        return text

    assert first.continuable(decode)
    assert not first.continuable(None)
    assert _first().continuable(None)  # a token with text of its own


def test_decode_gets_prompt_ids_plus_the_token_and_one_token_less() -> None:
    req = parsed(
        CHAT, max_completion_tokens=9, temperature=0.3, stream_options={"include_usage": True}
    )
    body = json.loads(continuation_body(req, _first(CHAT).decode_prompt, KV))
    assert body == {
        "prompt": [5, 6, 7, 42],
        "model": "m",
        "max_tokens": 8,
        "temperature": 0.3,
        "stream_options": {"include_usage": True},
        "stream": True,
        "kv_transfer_params": {"pdplane_transfer_id": "t"},
    }
    # completions' default of 16, and chat's "up to the model's length"
    assert (
        json.loads(continuation_body(parsed(COMPLETIONS), _first().decode_prompt, KV))["max_tokens"]
        == 15
    )
    assert (
        json.loads(continuation_body(parsed(CHAT), _first(CHAT).decode_prompt, KV))["max_tokens"]
        is None
    )
    # a decode taking over without prefill's KV: the same body, no kv_transfer_params
    without = json.loads(continuation_body(req, _first(CHAT).decode_prompt, None))
    assert without == {k: v for k, v in body.items() if k != "kv_transfer_params"}


def test_the_request_ends_at_prefill_on_a_stop_token_or_one_token_asked() -> None:
    assert not _first().ends_request(parsed(COMPLETIONS, max_tokens=5))
    assert _first(finish_reason="stop", stop_reason=2).ends_request(parsed(COMPLETIONS))
    assert _first().ends_request(parsed(COMPLETIONS, max_tokens=1))


def test_the_request_ends_at_prefill_when_decodes_prompt_would_fill_the_model() -> None:
    # prompt of 3 tokens: decode's would be 4, which a max_model_len of 4 refuses
    assert _first().ends_request(parsed(CHAT), max_model_len=4)
    assert _first().ends_request(parsed(COMPLETIONS, max_tokens=5), max_model_len=4)
    assert not _first().ends_request(parsed(CHAT), max_model_len=5)
    assert not _first().ends_request(parsed(CHAT), max_model_len=0)  # unknown


def test_completions_chunks_pass_with_the_responses_id_and_usage_counts_the_first_token() -> None:
    req = parsed(COMPLETIONS, stream_options={"include_usage": True})
    splice = Splice(req, _first())
    (opening,) = _events(splice.opening())
    assert opening["id"] == "cmpl-r1" and opening["choices"][0]["text"] == " Hello"
    chunk = b'data: {"id":"cmpl-d","object":"text_completion","created":101,"model":"m",' \
            b'"choices":[{"index":0,"text":" world","finish_reason":null}]}\n\n'  # fmt: skip
    out = splice.rewrite(chunk)
    assert out == chunk.replace(b'"cmpl-d"', b'"cmpl-r1"')
    usage = b'data: {"id":"cmpl-d","object":"text_completion","created":101,"model":"m",' \
            b'"choices":[],"usage":{"prompt_tokens":4,"total_tokens":6,' \
            b'"completion_tokens":2}}\n\ndata: [DONE]\n\n'  # fmt: skip
    (last, done) = _events(splice.rewrite(usage))
    assert last["id"] == "cmpl-r1"
    assert last["usage"] == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}
    assert done == "[DONE]"


def test_chat_chunks_are_made_from_decodes_completions_chunks() -> None:
    req = parsed(CHAT, stream_options={"include_usage": True})
    splice = Splice(req, _first(CHAT))
    role, token = _events(splice.opening())
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert token["choices"][0]["delta"] == {"content": " Hello"}
    assert {role["object"], token["object"]} == {"chat.completion.chunk"}
    decode = (
        b'data: {"id":"cmpl-d","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":" world","finish_reason":null,"stop_reason":null}]}\n\n'
        b'data: {"id":"cmpl-d","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":"!","finish_reason":"length","stop_reason":null}]}\n\n'
        b'data: {"id":"cmpl-d","object":"text_completion","created":1,"model":"m",'
        b'"choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3}}\n\n'
        b"data: [DONE]\n\n"
    )
    world, end, usage, done = _events(splice.rewrite(decode))
    assert world["id"] == end["id"] == usage["id"] == "chatcmpl-r1"
    assert world["object"] == "chat.completion.chunk"
    assert world["choices"][0]["delta"] == {"content": " world"}
    assert world["choices"][0]["finish_reason"] is None
    assert end["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}
    assert done == "[DONE]"


def _token_event(text: str, layout: str) -> bytes:
    """Decode's completions chunk of one token (no finish_reason) in `layout`: "vllm" as vLLM
    0.32 writes it (`model_dump_json(exclude_unset=True)`: non-ASCII as UTF-8), "sim" as the
    sim does, "ids" with token ids, "other" an order no engine writes."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    head: dict[str, Any] = {"id": "cmpl-d", "object": "text_completion", "created": 7}
    if layout == "vllm":
        choice.update(stop_reason=None, prompt_token_ids=None, token_ids=None)
        obj = {**head, "model": "m", "choices": [choice]}
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    if layout == "ids":
        choice.update(stop_reason=None, prompt_token_ids=None, token_ids=[17])
    obj = {**head, "model": "m", "choices": [choice], "usage": None}
    if layout == "other":
        obj = {"model": "m", **head, "choices": [choice], "system_fingerprint": None}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


@pytest.mark.parametrize("text", [" world", "", 'say "hi"\\', "a\nb\tc", "é ü 日本 \u2028", "\x7f"])
@pytest.mark.parametrize("layout", ["vllm", "sim", "ids"])
def test_chat_token_chunks_are_the_same_bytes_whatever_decodes_layout(
    text: str, layout: str
) -> None:
    # Token chunks in the engines' layouts are rebuilt from their text's bytes; the result is
    # byte for byte the chunk made by parsing the event (a layout that only parsing handles).
    splice = Splice(parsed(CHAT), _first(CHAT))
    made = splice.rewrite(_token_event(text, layout) + b"\n\n")
    assert made == splice.rewrite(_token_event(text, "other") + b"\n\n")
    (chunk,) = _events(made)
    assert chunk == {
        "id": "chatcmpl-r1",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": None,
            }
        ],
    }


def test_chat_chunks_with_continuous_usage_count_the_first_token() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    splice = Splice(parsed(CHAT, stream_options=options), _first(CHAT))
    event = (
        b'data: {"id":"cmpl-d","object":"text_completion","created":7,"model":"m","choices":'
        b'[{"index":0,"text":" world","logprobs":null,"finish_reason":null}],"usage":'
        b'{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}}\n\n'
    )
    (chunk,) = _events(splice.rewrite(event))
    assert chunk["choices"][0]["delta"] == {"content": " world"}
    assert chunk["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


def test_a_malformed_token_event_passes_unchanged() -> None:
    splice = Splice(parsed(CHAT), _first(CHAT))
    bad = _token_event("x", "sim").replace(b'"x"', b'"\\x"') + b"\n\n"  # invalid escape
    assert splice.rewrite(bad) == bad


def test_an_error_event_from_decode_passes_unchanged() -> None:
    splice = Splice(parsed(CHAT), _first(CHAT))
    error = b'data: {"error":{"message":"boom","code":500}}\n\n'
    assert splice.rewrite(error) == error


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_request_ended_by_prefill_streams_one_token_then_usage_and_done(
    endpoint: Endpoint,
) -> None:
    req = parsed(endpoint, max_tokens=1, stream_options={"include_usage": True})
    events = _events(Splice(req, _first(endpoint)).ending())
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    finish = events[-3]["choices"][0]
    assert finish["finish_reason"] == "length"
    text = finish["text"] if endpoint == COMPLETIONS else finish["delta"]["content"]
    assert text == " Hello"


def test_a_special_token_inside_a_held_character_is_skipped_as_one_instance_skips_it() -> None:
    from tokenizers.decoders import DecodeStream

    tok = _byte_level_tokenizer()
    tok.add_special_tokens(["</s>"])
    eos = tok.token_to_id("</s>")
    prompt, emoji = tok.encode("hello ").ids, tok.encode("\U0001f600").ids
    out = [emoji[0], eos]  # decode stops (EOS) with the character still open
    single = DecodeStream(ids=prompt, skip_special_tokens=True)
    assert [single.step(tok, t) or "" for t in out] == ["", ""]

    def decode(ids: list[int]) -> str:  # the attempt's, with the client's default skip
        text: str = tok.decode(ids, skip_special_tokens=True)
        return text

    first = _first(prompt_token_ids=prompt, token_id=out[0], text="")
    splice = Splice(parsed(COMPLETIONS), first, decode)
    rewritten = _events(splice.rewrite(_decode_stream([*prompt, out[0]], out[1:])))
    assert [c["text"] for e in rewritten if isinstance(e, dict) for c in e["choices"]] == [""]


@pytest.mark.parametrize("per_chunk", [1, 4])
@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_a_stop_token_ending_a_held_character_is_left_out_of_its_text(
    per_chunk: int, stop: str
) -> None:
    # vLLM's detokenizer leaves the stop token out of the text (unless
    # include_stop_str_in_output), also when special tokens are not skipped.
    tok = _byte_level_tokenizer()
    tok.add_special_tokens(["</s>"])
    eos = tok.token_to_id("</s>")
    prompt, emoji = tok.encode("hello ").ids, tok.encode("\U0001f600").ids
    out = [*emoji, eos] if per_chunk > 1 else [emoji[0], eos]

    def decode(ids: list[int]) -> str:  # skip_special_tokens: false
        text: str = tok.decode(ids, skip_special_tokens=False)
        return text

    extra = {"skip_special_tokens": False}
    if stop == "stop_token_ids":
        extra["stop_token_ids"] = [eos]  # type: ignore[assignment]
    first = _first(prompt_token_ids=prompt, token_id=out[0], text="")
    events = _decode_stream([*prompt, out[0]], out[1:], per_chunk).replace(
        b'"finish_reason":"length","stop_reason":null',
        b'"finish_reason":"stop","stop_reason":'
        + (b"null" if stop == "eos" else str(eos).encode()),
    )
    splice = Splice(parsed(COMPLETIONS, **extra), first, decode)
    got = [c["text"] for e in _events(splice.rewrite(events)) if isinstance(e, dict)
           for c in e["choices"]]  # fmt: skip
    assert "".join(got) == ("" if per_chunk == 1 else "\U0001f600")
    # with include_stop_str_in_output the stop token's text is the client's
    kept = Splice(parsed(COMPLETIONS, include_stop_str_in_output=True, **extra), first, decode)
    got = [c["text"] for e in _events(kept.rewrite(events)) if isinstance(e, dict)
           for c in e["choices"]]  # fmt: skip
    assert "".join(got).endswith("</s>")


def test_a_special_token_after_a_prompts_open_character_is_seen_as_the_client_sees_it() -> None:
    # "hi", the first byte of an emoji, then a special token: kept, the prompt ends on the
    # special token; skipped (the client's default), it ends inside the character.
    tok = _byte_level_tokenizer()
    tok.add_special_tokens(["<|assistant|>"])
    special = tok.token_to_id("<|assistant|>")
    emoji = tok.encode("\U0001f600").ids
    prompt = [*tok.encode("hi").ids, emoji[0], special]

    def kept(ids: list[int]) -> str:
        text: str = tok.decode(ids, skip_special_tokens=False)
        return text

    def skipped(ids: list[int]) -> str:
        text: str = tok.decode(ids, skip_special_tokens=True)
        return text

    first = _first(prompt_token_ids=prompt, token_id=emoji[1], text="")
    assert first.continuable(kept)  # special tokens kept by the client too
    assert not first.continuable(kept, skipped)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_text_prompt_ending_with_a_replacement_character_still_takes_prefills_token(
    endpoint: Endpoint,
) -> None:
    # A prompt sent as text ends on a whole character, whatever that character is: one that
    # is U+FFFD itself (common in prompts made of random token ids, e.g. `vllm bench serve`'s
    # random dataset) is no open character, and the first token from prefill still goes out.
    tok = _byte_level_tokenizer()
    prompt = tok.encode("hello \ufffd").ids
    assert tok.decode(prompt).endswith("\ufffd")
    padded = tok.get_vocab_size() + 5  # decodes to nothing, as most ids of a padded vocabulary
    first = _first(endpoint, prompt_token_ids=prompt, token_id=padded, text="")
    req = parsed(endpoint, **({"prompt": "hello \ufffd"} if endpoint == COMPLETIONS else {}))
    splice = splice_for(req, first, tok)
    assert splice is not None
    assert not splice.token_ids  # nothing held: the token adds no bytes to a character
    # a token that opens a character after it is held as before
    emoji = tok.encode("\U0001f600").ids
    opening = _first(endpoint, prompt_token_ids=prompt, token_id=emoji[0], text="")
    held = splice_for(req, opening, tok)
    assert held is not None and held.token_ids


def test_a_token_id_prompt_ending_with_a_replacement_character_takes_the_usual_path() -> None:
    # Ids may end inside a character, and the tokenizer's text cannot tell that from a whole
    # U+FFFD: such a prompt keeps the usual path (the first token from decode).
    tok = _byte_level_tokenizer()
    prompt = tok.encode("hello \ufffd").ids
    padded = tok.get_vocab_size() + 5
    first = _first(prompt_token_ids=prompt, token_id=padded, text="")
    assert splice_for(parsed(COMPLETIONS, prompt=prompt), first, tok) is None
    assert splice_for(parsed(COMPLETIONS, prompt=prompt), _first(), tok) is not None
    assert splice_for(parsed(COMPLETIONS, prompt=prompt), first, None) is None  # no tokenizer
