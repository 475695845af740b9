"""The first token from prefill: which requests take it, what decode is sent, and how decode's
chunks are rewritten into the client's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdplane.gateway.first_token import FirstToken, Splice, applies, decode_body
from pdplane.gateway.validation import CHAT, COMPLETIONS, Endpoint, parse_request

KV = b'{"pdplane_transfer_id":"t"}'


def _req(endpoint: Endpoint, **body: Any) -> Any:
    base: dict[str, Any] = {"model": "m", "stream": True}
    if endpoint == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return parse_request(endpoint, json.dumps({**base, **body}).encode())


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
    assert applies(_req(endpoint, max_tokens=8, temperature=0.7, top_p=0.9, ignore_eos=True))
    assert applies(_req(endpoint, stream_options={"include_usage": True}, n=1, stop=[]))


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
    assert not applies(_req(COMPLETIONS, **extra))


def test_neutral_values_of_the_checked_fields_apply() -> None:
    neutral = {"stop": [], "presence_penalty": 0.0, "frequency_penalty": 0, "min_tokens": 0}
    assert applies(_req(COMPLETIONS, seed=None, logprobs=None, echo=False, **neutral))


def test_chat_with_tools_or_logprobs_does_not_apply() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert not applies(_req(CHAT, tools=tools))
    assert not applies(_req(CHAT, logprobs=True))
    assert applies(_req(CHAT, logprobs=False))


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


def _byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["hello there, hello again"], trainer=trainer)
    return tok


def test_a_first_token_that_starts_a_character_takes_the_usual_path() -> None:
    # vLLM's detokenizer holds back a token that ends inside a UTF-8 character: prefill's
    # text is "". Decode's detokenizer, primed with a prompt that ends inside that
    # character (`DecodeStream(ids=prompt)`, as vLLM 0.32 does), would emit the prompt's
    # text again with the character: decode's text cannot continue such a first token.
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

    assert not first.continuable(decode)  # the model's tokenizer: inside a character
    assert not first.continuable(None)  # no tokenizer: no text is taken as that
    # a first token that ends the request (EOS, skipped) needs no continuation
    ending = {**answer, "choices": [{**answer["choices"][0], "finish_reason": "stop"}]}
    stop = FirstToken.of(COMPLETIONS, ending)
    assert stop is not None and stop.continuable(None)


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
    req = _req(
        CHAT, max_completion_tokens=9, temperature=0.3, stream_options={"include_usage": True}
    )
    body = json.loads(decode_body(req, _first(CHAT), KV))
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
    assert json.loads(decode_body(_req(COMPLETIONS), _first(), KV))["max_tokens"] == 15
    assert json.loads(decode_body(_req(CHAT), _first(CHAT), KV))["max_tokens"] is None


def test_the_request_ends_at_prefill_on_a_stop_token_or_one_token_asked() -> None:
    assert not _first().ends_request(_req(COMPLETIONS, max_tokens=5))
    assert _first(finish_reason="stop", stop_reason=2).ends_request(_req(COMPLETIONS))
    assert _first().ends_request(_req(COMPLETIONS, max_tokens=1))


def test_the_request_ends_at_prefill_when_decodes_prompt_would_fill_the_model() -> None:
    # prompt of 3 tokens: decode's would be 4, which a max_model_len of 4 refuses
    assert _first().ends_request(_req(CHAT), max_model_len=4)
    assert _first().ends_request(_req(COMPLETIONS, max_tokens=5), max_model_len=4)
    assert not _first().ends_request(_req(CHAT), max_model_len=5)
    assert not _first().ends_request(_req(CHAT), max_model_len=0)  # unknown


def test_completions_chunks_pass_with_the_responses_id_and_usage_counts_the_first_token() -> None:
    req = _req(COMPLETIONS, stream_options={"include_usage": True})
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
    req = _req(CHAT, stream_options={"include_usage": True})
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
    splice = Splice(_req(CHAT), _first(CHAT))
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
    splice = Splice(_req(CHAT, stream_options=options), _first(CHAT))
    event = (
        b'data: {"id":"cmpl-d","object":"text_completion","created":7,"model":"m","choices":'
        b'[{"index":0,"text":" world","logprobs":null,"finish_reason":null}],"usage":'
        b'{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}}\n\n'
    )
    (chunk,) = _events(splice.rewrite(event))
    assert chunk["choices"][0]["delta"] == {"content": " world"}
    assert chunk["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


def test_a_malformed_token_event_passes_unchanged() -> None:
    splice = Splice(_req(CHAT), _first(CHAT))
    bad = _token_event("x", "sim").replace(b'"x"', b'"\\x"') + b"\n\n"  # invalid escape
    assert splice.rewrite(bad) == bad


def test_an_error_event_from_decode_passes_unchanged() -> None:
    splice = Splice(_req(CHAT), _first(CHAT))
    error = b'data: {"error":{"message":"boom","code":500}}\n\n'
    assert splice.rewrite(error) == error


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_request_ended_by_prefill_streams_one_token_then_usage_and_done(
    endpoint: Endpoint,
) -> None:
    req = _req(endpoint, max_tokens=1, stream_options={"include_usage": True})
    events = _events(Splice(req, _first(endpoint)).ending())
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    finish = events[-3]["choices"][0]
    assert finish["finish_reason"] == "length"
    text = finish["text"] if endpoint == COMPLETIONS else finish["delta"]["content"]
    assert text == " Hello"
