"""Stop strings matched across token boundaries, with text held back while one may be starting.

    seen text:  ... emitted | held (a proper prefix of some stop string) | new text
                            `------------- searched for a stop string ------------'

Held text is released once it can no longer start a stop string, or at finish, so streamed
deltas concatenated always equal the final (truncated) text.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.tail = ""  # the last max_stop_len - 1 characters seen (emitted or held)
        self.num_held = 0  # characters at the end of `tail` not emitted yet

    def step(self, new_text: str, can_stop: bool = True) -> tuple[str, str | None]:
        """Returns (text to emit now, the stop string if one completed in new_text).

        can_stop is False while min_tokens is not reached: nothing fires, text is still held.
        """
        if not self.stop:
            return new_text, None
        window = self.tail + new_text
        emit_from = len(self.tail) - self.num_held
        match = self._find(window, len(self.tail)) if can_stop else None
        if match is not None:
            start, end, stop_str = match
            cut = end if self.include_stop_str_in_output else start
            self.tail, self.num_held = "", 0
            return window[emit_from:cut], stop_str
        held = 0 if self.include_stop_str_in_output else self._partial_len(window)
        keep = self.max_stop_len - 1
        self.tail = window[max(0, len(window) - keep) :]
        self.num_held = held
        return window[emit_from : len(window) - held], None

    def flush(self) -> str:
        """At finish without a stop string: the held text is ordinary output after all."""
        held = self.tail[len(self.tail) - self.num_held :] if self.num_held else ""
        self.tail, self.num_held = "", 0
        return held

    def _find(self, window: str, old_len: int) -> tuple[int, int, str] | None:
        """The stop string that completes first in the new part of the window (ends > old_len)."""
        best = None
        for s in self.stop:
            idx = window.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or (idx + len(s), idx) < best[1::-1]):
                best = (idx, idx + len(s), s)
        return best

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
