"""Generated tokens to text as they come: detokenized in a window (an incomplete UTF-8 character held back), and cut
at the first stop string (the text that may yet become one held back too)."""
from __future__ import annotations


class Detokenizer:
    """Incremental decoding: each token's text is the decode of a short window of recent tokens minus that of the
    window without it, so a byte-level BPE's merged characters and a SentencePiece's leading spaces come out right."""

    def __init__(self, decode):
        self.decode, self.ids, self.start, self.read = decode, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.start:self.read])
        now = self.decode(self.ids[self.start:])
        if now.endswith("\ufffd") or len(now) < len(before):
            return ""  # a character still incomplete
        self.start, self.read = max(self.read - 4, 0), len(self.ids)
        return now[len(before):]


class StopStrings:
    """The text so far, the part safe to show, and whether a stop string has ended it (OpenAI drops the stop)."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.shown, self.stopped = stops, "", 0, False

    def push(self, piece: str) -> str:
        """The new text that may be shown now."""
        if self.stopped:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s, max(self.shown - len(s), 0)) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)
        end = len(self.text) - hold
        out = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return out

    def flush(self) -> str:
        out = self.text[self.shown:]
        self.shown = len(self.text)
        return out
