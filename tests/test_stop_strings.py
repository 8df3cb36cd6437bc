"""Stop strings on text that arrives in pieces, against the plain rule: cut the whole text at the first stop."""

import pytest

from engine.stop_strings import StopStrings, cut_at_stop


def shown_in_pieces(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    matcher = StopStrings(stops)
    shown = [matcher.push(p) for p in pieces]
    shown.append(matcher.flush())
    return shown, matcher.stopped


@pytest.mark.parametrize(
    "pieces,stops",
    [
        (["Hello", " wor", "ld", "\n\nUser", ":", " more"], ["\n\nUser:"]),  # spans four pieces
        (["a", "b", "a", "b", "c", "d"], ["abc"]),  # a false start right before the real one
        (["x", "END"], ["END", "x"]),  # the first stop in the text wins, whatever the list order
        (["no stop ", "here", " at all"], ["###"]),
        (["ends with a partial #", "#"], ["###"]),  # held back, then released at the end
        (["", "E", "", "N", "D!"], ["END"]),
    ],
)
def test_pieces_give_the_text_cut_at_the_first_stop(pieces, stops):
    text = "".join(pieces)
    starts = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(starts)] if starts else text
    shown, stopped = shown_in_pieces(pieces, stops)
    assert "".join(shown) == expected == cut_at_stop(text, stops)
    assert stopped == bool(starts)


def test_text_is_shown_as_soon_as_it_cannot_start_a_stop():
    shown, _ = shown_in_pieces(["Hello", " Us", "e", "ful"], ["User:"])
    assert shown == ["Hello", " ", "", "Useful", ""]


def test_nothing_comes_after_a_stop():
    matcher = StopStrings(["STOP"])
    assert matcher.push("go STOP and more") == "go "
    assert matcher.push("later text") == "" and matcher.flush() == ""
