"""StopStringChecker: any split of the text gives the reference cut, and a stop string never leaks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenriver.errors import InvalidParameterError
from tokenriver.tokenizer.detokenizer import IncrementalDetokenizer
from tokenriver.tokenizer.stop_strings import StopStringChecker

ALPHABET = "ab<|>é 😀"


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the first position where some stop string is complete; the longest one ending there."""
    for end in range(1, len(text) + 1):
        complete = [stop for stop in stops if text[:end].endswith(stop)]
        if complete:
            stop = max(complete, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def reference_num_held(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return max(
        (n for n in range(1, len(text) + 1) for stop in stops if n < len(stop) and stop.startswith(text[-n:])),
        default=0,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4),
    include=st.booleans(),
    data=st.data(),
)
def test_any_split_gives_the_reference_cut(text, stops, include, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    checker = StopStringChecker(stops, include)
    emitted, matched, fed = [], None, ""
    for piece in pieces:
        fed += piece
        out, matched = checker.process(piece)
        emitted.append(out)
        if matched is not None:
            break
        # Only the tail that could still become a stop string is held back.
        assert len(fed) - len("".join(emitted)) == reference_num_held(fed, stops)
    if matched is None:
        emitted.append(checker.flush())
    expected_text, expected_stop = reference_cut(text, stops, include)
    assert "".join(emitted) == expected_text == checker.text
    assert matched == expected_stop
    if expected_stop is not None and not include:
        assert expected_stop not in "".join(emitted)
        # Nothing more comes out after a match.
        assert checker.process("more") == ("", None)
        assert checker.flush() == ""


def test_earliest_completed_stop_wins():
    checker = StopStringChecker(["abcd", "bc"], include_stop_str_in_output=False)
    assert checker.process("xabcd") == ("xa", "bc")
    checker = StopStringChecker(["c", "bc"], include_stop_str_in_output=True)
    assert checker.process("abcd") == ("abc", "bc")


def test_held_back_text_is_released_when_it_stops_matching():
    checker = StopStringChecker(["STOP"], include_stop_str_in_output=False)
    assert checker.process("go ST") == ("go ", None)
    assert checker.process("OR") == ("STOR", None)
    assert checker.process("ST") == ("", None)
    assert checker.flush() == "ST"
    assert checker.text == "go STORST"


def test_no_stop_strings_passes_everything_through():
    checker = StopStringChecker([], include_stop_str_in_output=False)
    assert checker.process("anything") == ("anything", None)
    assert checker.flush() == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [None]])
def test_empty_stop_string_is_rejected(stop):
    with pytest.raises(InvalidParameterError) as error:
        StopStringChecker(stop, include_stop_str_in_output=False)
    assert error.value.param == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_stop_spanning_three_tokens_of_the_real_tokenizer(smollm_tokenizer, include):
    text = "The answer is forty-two. Then more text follows."
    stop = " forty-two"
    ids = smollm_tokenizer.encode(text)
    # Tokens whose text overlaps the stop string.
    start = text.index(stop)
    spans, offset = [], 0
    for token_id in ids:
        piece = smollm_tokenizer.decode([token_id])
        if offset < start + len(stop) and offset + len(piece) > start:
            spans.append(piece)
        offset += len(piece)
    assert len(spans) >= 3, spans

    detokenizer = IncrementalDetokenizer(smollm_tokenizer, smollm_tokenizer.encode("Q: "))
    checker = StopStringChecker(["never", stop], include)
    emitted, matched = [], None
    for token_id in ids:
        out, matched = checker.process(detokenizer.add_tokens([token_id]))
        emitted.append(out)
        if matched is not None:
            break
    assert matched == stop
    assert "".join(emitted) == "The answer is" + (stop if include else "")
