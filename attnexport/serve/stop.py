"""Stop strings over streamed text: the text before the first stop string, never the stop
string itself, and never a character that a later delta could turn into one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Filters the text deltas of one sample.

    Holds back the last ``max(len(stop)) - 1`` characters until later text shows they do not
    start a stop string: everything emitted before was checked, so a stop string that ends in
    new text starts inside the held-back part (this is why the check is linear in the text,
    not a search of the whole output each time).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, delta: str, final: bool = False) -> str:
        """Adds ``delta``; returns the text that is now safe to emit. Sets :attr:`stopped`
        when a stop string appeared (the text before it is returned; later pushes return "").
        ``final``: the sample ended, so nothing is held back."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        keep = 0 if final else min(self._hold, len(text))
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep]
