"""What a sim answers: per choice, its output tokens, their text, its stop.

Output is a pure function of the prompt's ids and the seed (`pdplane.sim.tokens`): a decode
continuing prefill's first token, or a prompt ending in part of its own answer (a stream
resumed elsewhere), continues that answer. With `n` > 1 each choice is drawn on its own, with
the seed `SimRequest.seed_of` gives it (vLLM seeds a parallel-sampling child with seed +
index); stop strings end each choice on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdplane.sim.kvflow import KvIntent
from pdplane.sim.protocol import SimRequest
from pdplane.sim.tokens import Tokenizer, continuation, resumed

__all__ = ["Answer", "answer_of"]


@dataclass(frozen=True, slots=True)
class Answer:
    """One choice's output.

    Attributes:
        ids: the output token ids, up to the one that completed a stop string.
        pieces: the text each token's chunk streams (stop strings hold some back).
        tokens: each token's own text (logprobs name them; `text_offset` follows them).
        stop: the stop string that ended it; None: it ran to its length.
    """

    ids: list[int]
    pieces: list[str]
    tokens: list[str]
    stop: str | None


def answer_of(
    tok: Tokenizer,
    req: SimRequest,
    intent: KvIntent | None,
    role: str,
    seed: int,
) -> Answer:
    """The answer to `req` drawn with `seed` (a choice's, `SimRequest.seed_of`); `intent`:
    the request's KV role, `role`: the sim's ("prefill" answers one token to a producer's
    request)."""
    producer = intent is not None and intent.role == "producer"
    consumer = intent is not None and intent.role == "consumer"
    wanted = 1 if producer else req.max_tokens
    answer = None
    if consumer and intent is not None and intent.decode is not None:
        # Prefill's prompt + its first token (the gateway streamed that one already).
        answer = continuation(tok, req.prompt_ids, intent.num_tokens, seed, req.max_tokens)
    elif intent is None and role == "decode" and not req.chat:
        # The same prompt computed here, without KV (a decode taking over from one that
        # could not be reached): a model continues its own first token the same way.
        answer = continuation(tok, req.prompt_ids, len(req.prompt_ids) - 1, seed, req.max_tokens)
    if answer is None and req.prompt_as_ids and req.return_token_ids:
        # A prompt that ends in part of its own answer (a stream resumed elsewhere: the
        # gateway asks for token ids on those legs). Other prompts are not searched: a
        # prompt whose last id merely equals its own first sampled token (1 in
        # len(VOCAB)) keeps its own answer.
        answer = resumed(tok, req.prompt_ids, seed, wanted)
    ids, pieces = answer or tok.sample(req.key, seed, wanted)
    tokens = pieces
    stopped = req.stop.apply(pieces) if req.stop is not None else None
    if stopped is None:
        return Answer(ids, pieces, tokens, None)
    # the engine stops at the token that completes a stop string
    return Answer(ids[: len(stopped.deltas)], stopped.deltas, tokens, stopped.stop)
