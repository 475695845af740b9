"""A sim continues its own answer fed back as the prompt (`pdplane.sim.tokens.resumed`)."""

from __future__ import annotations

from pdplane.sim.tokens import VOCAB, WordTokenizer, prompt_key, resumed


def test_a_prompt_ending_in_its_own_answer_gets_the_rest_of_it() -> None:
    tok = WordTokenizer()
    prompt = tok.encode("the prompt of a stream resumed on another decode")
    answer, pieces = tok.sample(prompt_key(prompt), 0, 30)
    for sent in (1, 12, 29):
        ids, text = resumed(tok, [*prompt, *answer[:sent]], 0, 30 - sent)  # type: ignore[misc]
        assert ids == answer[sent:] and text == pieces[sent:]


def test_other_prompts_are_answered_as_before() -> None:
    tok = WordTokenizer()
    assert resumed(tok, tok.encode("a prompt of its own"), 0, 5) is None
    words = tok.encode(" ".join(VOCAB[i % len(VOCAB)] for i in range(300)))
    assert resumed(tok, words, 0, 5) is None  # a long tail of sampleable ids: searched, no match
