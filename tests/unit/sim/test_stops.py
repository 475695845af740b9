"""The sim's stop strings behave as vLLM's detokenizer: the text is cut at the first stop
string, a stream holds back (longest stop string - 1) characters until it can tell they start
none, and `include_stop_str_in_output` keeps the string and holds nothing back."""

from __future__ import annotations

from pdplane.sim.stops import StopStrings, parse_stop

PIECES = [" alpha", " beta", " gamma", " delta", " eps"]


def test_the_text_is_cut_before_the_first_stop_string_and_the_stream_holds_back() -> None:
    stopped = StopStrings(("ta gam", "zzz"), include=False).apply(PIECES)
    assert stopped.stop == "ta gam"
    assert stopped.text == " alpha be"
    # hold 5 characters (longest stop 6 - 1) until the token that completes the stop
    assert stopped.deltas == [" ", "alpha", " be"]
    assert "".join(stopped.deltas) == stopped.text


def test_stop_strings_are_searched_in_the_order_given() -> None:
    stopped = StopStrings(("gamma", "beta"), include=False).apply(PIECES)
    assert stopped.stop == "beta" and stopped.text == " alpha "  # beta ends first
    stopped = StopStrings(("a g", " beta gamma"), include=False).apply(PIECES)
    assert stopped.stop == "a g" and stopped.text == " alpha bet"


def test_include_keeps_the_stop_string_and_holds_nothing_back() -> None:
    stopped = StopStrings(("ta ga",), include=True).apply(PIECES)
    assert stopped.deltas == [" alpha", " beta", " ga"]
    assert stopped.text == " alpha beta ga" and stopped.stop == "ta ga"


def test_no_stop_found_releases_the_held_characters_with_the_last_token() -> None:
    stopped = StopStrings(("a stop string nowhere to be seen",), include=False).apply(PIECES)
    assert stopped.stop is None
    assert stopped.deltas[:-1] == ["", "", "", ""]
    assert stopped.deltas[-1] == "".join(PIECES) == stopped.text


def test_parse_stop_takes_vllms_shapes() -> None:
    assert parse_stop({}) is None and parse_stop({"stop": []}) is None
    assert parse_stop({"stop": "x"}) == StopStrings(("x",), False)
    both = {"stop": ["a", "b"], "include_stop_str_in_output": True}
    assert parse_stop(both) == StopStrings(("a", "b"), True)
    assert parse_stop({"stop": [""]}) == "stop cannot contain an empty string."
    assert isinstance(parse_stop({"stop": 3}), str)
