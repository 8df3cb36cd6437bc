"""Stop strings: end an answer where a given text appears, however the tokens split it.

The text of a row arrives in pieces (one per decoded token, or less). A stop string may span
several pieces, so the end of the text that could still become one is held back until the next
piece settles it. The answer shown ends before the stop string, as llama.cpp's server and the
OpenAI API end it.
"""


class StopStrings:
    def __init__(self, stops: list[str]):
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        self.stops = stops
        self.pending = ""  # text received but not yet released
        self.stopped = False

    def push(self, piece: str) -> str:
        """Take the next piece of text; return what can be shown now. After a stop string,
        `stopped` is True and nothing more is ever returned."""
        if self.stopped:
            return ""
        self.pending += piece
        ends = [i for i in (self.pending.find(stop) for stop in self.stops) if i >= 0]
        if ends:
            self.stopped = True
            shown, self.pending = self.pending[: min(ends)], ""
            return shown
        held = self._longest_partial_stop()
        shown = self.pending[: len(self.pending) - held]
        self.pending = self.pending[len(shown) :]
        return shown

    def flush(self) -> str:
        """The end of the answer: whatever was held back is not a stop string after all."""
        shown, self.pending = ("" if self.stopped else self.pending), ""
        return shown

    def _longest_partial_stop(self) -> int:
        """Length of the longest end of the pending text that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def cut_at_stop(text: str, stops: list[str]) -> str:
    """The text up to its first stop string (all of it when none appears)."""
    matcher = StopStrings(stops)
    return matcher.push(text) + matcher.flush()
