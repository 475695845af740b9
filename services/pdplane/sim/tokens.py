"""Token ids for the simulator: a deterministic word tokenizer, or the model's own tokenizer.

The default `WordTokenizer` needs no files: a token is a word or a punctuation mark
(`\\w+|[^\\w\\s]`), its id a CRC-32 of the word folded into a 32 000-id vocabulary (ids below 16
are the chat template's markers), so equal text always gives equal ids in every process. A chat
request becomes, per message, `<start> <role> <sep> content... <end>` (4 template tokens), plus
`<start> <assistant> <sep>` for the reply (3). Generated tokens are words of `VOCAB` with a
leading space, so an answer sent back in the next turn of a conversation tokenizes to exactly
the ids the engine generated: the prefix cache then sees the whole conversation as one prefix,
as with a real tokenizer.

`HfTokenizer` (`--tokenizer DIR`, a Hugging Face tokenizer directory, e.g. the one
`pdplane.models.tiny` builds) gives the ids the gateway's tokenizer gives (chat template
included), so prefix hashes computed by the gateway and by the scheduler match the sims'
cache. Its generated tokens are drawn from the vocabulary's whole-word tokens (" word" that
encodes back to itself), so an answer sent back re-tokenizes to the ids generated, as above.

Output is a pure function of (prompt token ids, seed) (`prompt_key`): a decode that loaded
remote KV answers exactly like a single instance, a prefill's one token is the first token of
that answer, and a prompt sent as text or as its token ids gets the same answer, as from a
real model. A decode whose prompt is prefill's plus that first token continues the same
answer (`continuation`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pdplane.core.kv_params import prompt_fingerprint

__all__ = [
    "VOCAB",
    "HfTokenizer",
    "Tokenizer",
    "WordTokenizer",
    "chat_prompt_tokens",
    "continuation",
    "count_text_tokens",
    "generate",
    "load_tokenizer",
    "prompt_key",
    "resumed",
]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
#: Chat template overhead, like a Llama-style template: tokens per message and for the reply.
_PER_MESSAGE_TOKENS = 4
_REPLY_PRIMER_TOKENS = 3

#: Output vocabulary: every generated token is one of these words with a leading space.
_WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "has had it or not first new one their its after who they have her she two been other "
    "when there all during into school time may years more most only over city some world "
    "would where later up such used many can state about national out known university "
    "united then made"
)
VOCAB: tuple[str, ...] = tuple(" " + w for w in _WORDS.split())

_VOCAB_SIZE = 32_000
#: HfTokenizer looks for whole-word output tokens among the first this many ids.
_MAX_SCANNED_IDS = 50_000
#: chat prompts HfTokenizer remembers (a prefill and its decode share one process's copy)
_RECENT_PROMPTS = 512
_SPECIAL = 16
_START, _SEP, _END, _EMPTY = 1, 2, 3, 4
_ROLE_IDS = {"system": 5, "user": 6, "assistant": 7, "tool": 8, "developer": 9}
_OTHER_ROLE = 10


def count_text_tokens(text: str) -> int:
    """Prompt length of `text` in tokens (words and punctuation marks; at least 1)."""
    return max(1, len(_TOKEN_RE.findall(text)))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt length of a chat request in tokens, template overhead included."""
    body = sum(count_text_tokens(_content_text(m.get("content"))) for m in messages)
    return body + _PER_MESSAGE_TOKENS * len(messages) + _REPLY_PRIMER_TOKENS


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """The sampling key of a prompt: `prompt_fingerprint` of its token ids (~20 us per 1,000
    tokens, an eighth of `WordTokenizer.encode`'s time; `git show a4bcc95:docs/benchmarks.md`)."""
    return prompt_fingerprint(prompt_ids)


def _rng(key: str, seed: int) -> random.Random:
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def generate(key: str, seed: int, num_tokens: int) -> list[str]:
    """The `num_tokens` output tokens (strings) for a prompt key and seed; pure function."""
    return _rng(key, seed).choices(VOCAB, k=num_tokens)


class Tokenizer(Protocol):
    """What the simulator needs of a tokenizer."""

    name: str
    #: the ids `sample` draws from
    output_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of a completions prompt (at least one)."""

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat prompt, template and reply primer included."""

    def sample(self, key: str, seed: int, num_tokens: int) -> tuple[list[int], list[str]]:
        """Output token ids and their text pieces for a prompt key and seed (pure; the first k
        of n tokens are the k-token answer)."""

    def alternatives(self, token_id: int, k: int) -> list[tuple[int, str]]:
        """`k` other output tokens (id, text) ranked after `token_id` (for logprobs; pure)."""


def _others(
    ids: Sequence[int], text: Callable[[int], str], token_id: int, k: int
) -> list[tuple[int, str]]:
    """The first `k` of the output ids `ids` other than `token_id`, with their text."""
    return [(i, text(i)) for i in ids[: k + 1] if i != token_id][:k]


class WordTokenizer:
    """The default deterministic tokenizer (see the module docstring)."""

    name = "pdplane-sim-words"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._vocab_ids = [self._word_id(w[1:]) for w in VOCAB]
        self.output_ids = frozenset(self._vocab_ids)

    def _word_id(self, word: str) -> int:
        wid = self._ids.get(word)
        if wid is None:
            wid = _SPECIAL + zlib.crc32(word.encode()) % (_VOCAB_SIZE - _SPECIAL)
            if len(self._ids) < 1_000_000:  # bounded memo
                self._ids[word] = wid
        return wid

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        out = [ids.get(w) or self._word_id(w) for w in _TOKEN_RE.findall(text)]
        return out or [_EMPTY]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        out: list[int] = []
        for m in messages:
            role = _ROLE_IDS.get(str(m.get("role")), _OTHER_ROLE)
            out += (_START, role, _SEP)
            out += self.encode(_content_text(m.get("content")))
            out.append(_END)
        out += (_START, _ROLE_IDS["assistant"], _SEP)
        return out

    def sample(self, key: str, seed: int, num_tokens: int) -> tuple[list[int], list[str]]:
        picks = _rng(key, seed).choices(range(len(VOCAB)), k=num_tokens)
        vids = self._vocab_ids
        return [vids[i] for i in picks], [VOCAB[i] for i in picks]

    def alternatives(self, token_id: int, k: int) -> list[tuple[int, str]]:
        return _others(self._vocab_ids, lambda i: VOCAB[self._vocab_ids.index(i)], token_id, k)


class HfTokenizer:
    """A Hugging Face tokenizer directory (`tokenizer.json` + config with a chat template).

    Raises ValueError when transformers cannot load it.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer

            self._tok: Any = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # transformers raises many kinds
            raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from exc
        self.name = path
        self._recent: OrderedDict[str, list[int]] = OrderedDict()
        special = set(self._tok.all_special_ids)
        self._pieces: dict[int, str] = {}
        words = []
        for i in range(min(len(self._tok), _MAX_SCANNED_IDS)):
            if i in special:
                continue
            piece = str(self._tok.decode([i]))
            if (
                piece[:1] == " "
                and piece[1:].isalpha()
                and self._tok.encode(piece, add_special_tokens=False) == [i]
            ):
                words.append(i)
                self._pieces[i] = piece
        self._choices = words or [i for i in range(len(self._tok)) if i not in special]
        self.output_ids = frozenset(self._choices)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text)) or [self._tok.bos_token_id or 0]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # A prefill and its decode in one process tokenize the same prompt: remember a few.
        key = json.dumps(messages, sort_keys=True, separators=(",", ":"))
        cached = self._recent.get(key)
        if cached is not None:
            self._recent.move_to_end(key)
            return cached
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # newer transformers: a BatchEncoding (not a dict)
            ids = ids["input_ids"]
        out = list(ids)
        self._recent[key] = out
        if len(self._recent) > _RECENT_PROMPTS:
            self._recent.popitem(last=False)
        return out

    def sample(self, key: str, seed: int, num_tokens: int) -> tuple[list[int], list[str]]:
        ids = _rng(key, seed).choices(self._choices, k=num_tokens)
        pieces = self._pieces
        out = []
        for i in ids:
            piece = pieces.get(i)
            if piece is None:
                piece = pieces[i] = self._tok.decode([i])
            out.append(piece)
        return ids, out

    def alternatives(self, token_id: int, k: int) -> list[tuple[int, str]]:
        return _others(
            self._choices, lambda i: self._pieces.get(i) or str(self._tok.decode([i])), token_id, k
        )


def continuation(
    tok: Tokenizer, prompt_ids: Sequence[int], num_computed: int, seed: int, num_tokens: int
) -> tuple[list[int], list[str]] | None:
    """The answer of a decode whose prompt is a prefill's `num_computed` tokens + the first
    token that prefill sampled: tokens 2 .. `num_tokens` + 1 of prefill's answer (ids, text).

    None unless `prompt_ids` is `num_computed` + 1 long and its last id is that first token
    (the prompt is then answered as any other).
    """
    if len(prompt_ids) != num_computed + 1 or num_computed < 1:
        return None
    key = prompt_key(prompt_ids[:num_computed])
    # `sample` draws token after token, so its first token is the 1-token answer's: the
    # common case (no continuation) costs one draw.
    if tok.sample(key, seed, 1)[0][0] != prompt_ids[-1]:
        return None
    ids, pieces = tok.sample(key, seed, num_tokens + 1)
    return ids[1:], pieces[1:]


#: How far back from a token-id prompt's end `resumed` looks for where its answer began
#: (tokens): the longest stream a gateway continues elsewhere with a sim's own continuation.
RESUME_WINDOW = 2048


def resumed(
    tok: Tokenizer, prompt_ids: Sequence[int], seed: int, num_tokens: int
) -> tuple[list[int], list[str]] | None:
    """The rest of an answer whose start is the end of the prompt: for `prompt_ids` = Q + the
    first m tokens a sim answers to Q (with `seed`), that answer's tokens m+1 .. m+`num_tokens`
    (ids, text), as a model continues greedy output fed back as its prompt (a gateway resuming
    a stream on another decode sends the prompt plus the tokens already sent). The longest such
    answer wins (the smallest Q); None when the prompt ends in no answer of its last
    `RESUME_WINDOW` tokens' prefixes.

    Only the prompt's tail of ids `sample` can draw is searched: one BLAKE2b digest and one
    seeded draw (~10 us) per position there, none for a prompt ending in other ids.
    """
    n = len(prompt_ids)
    lo = max(1, n - RESUME_WINDOW)
    drawn = tok.output_ids
    start = n
    while start > lo and prompt_ids[start - 1] in drawn:
        start -= 1
    if start == n:
        return None
    lo = max(start, 1)
    ids = array("q", prompt_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    raw = ids.tobytes()
    # `prompt_key` of each prefix, incrementally (the same digest as prompt_fingerprint's).
    digest = hashlib.blake2b(raw[: lo * 8], digest_size=8)
    for j in range(lo, n):
        key = digest.hexdigest()
        digest.update(raw[j * 8 : j * 8 + 8])
        if tok.sample(key, seed, 1)[0][0] != prompt_ids[j]:
            continue
        out, pieces = tok.sample(key, seed, n - j + num_tokens)
        if out[: n - j] == list(prompt_ids[j:]):
            return out[n - j :], pieces[n - j :]
    return None


def load_tokenizer(path: str | None) -> Tokenizer:
    """`HfTokenizer(path)` when a path is given, else the `WordTokenizer`."""
    return HfTokenizer(path) if path else WordTokenizer()
