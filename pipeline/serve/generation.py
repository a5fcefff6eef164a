"""One choice of a request: its tokens submitted to the engine, its events turned into text (detokenized, cut at a
stop string, masked by its grammar a token at a time), its end and its counts."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from pipeline.serve.engine import Engine, Sampling
from pipeline.serve.text import Detokenizer, StopStrings

FINISH = {"stop_token": "stop", "max_new_tokens": "length", "context_full": "length", "cancelled": "stop"}


def hex_mask(constraint) -> str:
    """The grammar's allowed tokens for the next sample, as the engine reads them."""
    import llguidance.torch as llt
    llt.fill_next_token_bitmask(constraint.matcher, constraint.bitmask, 0)
    words = (constraint.vocab + 31) // 32
    return constraint.bitmask[0, :words].numpy().view("<u4").tobytes().hex()


class GenerationError(RuntimeError):
    pass


class Choice:
    def __init__(self, engine: Engine, ids: list[int], sampling: Sampling, decode, stop_ids: set[int],
                 stops: list[str], constraint=None):
        self.engine, self.constraint, self.stop_ids = engine, constraint, stop_ids
        self.detok, self.stops = Detokenizer(decode), StopStrings(stops)
        self.prompt_tokens, self.generated, self.cached_tokens = len(ids), 0, 0
        self.finish_reason: Optional[str] = None
        self.done = False
        self.rid, self.queue = engine.submit(ids, sampling, hex_mask(constraint) if constraint else None)

    @property
    def text(self) -> str:
        return self.stops.text

    def cancel(self) -> None:
        if not self.done:
            self.engine.cancel(self.rid)

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it grows; finish_reason and the counts are set when it ends."""
        try:
            while True:
                ev = await self.queue.get()
                if ev["ev"] == "tokens":
                    for piece in self._take(ev["tokens"]):
                        yield piece
                elif ev["ev"] == "done":
                    self.done = True
                    self.cached_tokens = ev.get("cached_tokens", 0)
                    if ev.get("reason") == "error":
                        raise GenerationError(ev.get("error") or "the engine failed this request")
                    if self.finish_reason is None:
                        self.finish_reason = FINISH.get(ev.get("reason"), "stop")
                    rest = self.stops.flush()
                    if rest:
                        yield rest
                    return
        finally:
            self.cancel()  # a client gone, a timeout: the engine drops the session at its next step

    def _take(self, tokens: list[int]):
        for t in tokens:
            self.generated += 1
            if self.stops.stopped:
                continue
            if self.constraint is not None and not self.constraint.done:
                try:
                    self.constraint.consume(t)  # its end-of-text token too: the grammar then has ended
                except ValueError as e:  # a token outside the mask: never, unless the engine sampled wrong
                    raise GenerationError(f"the grammar refused the engine's token: {e}") from None
            if t in self.stop_ids:
                continue
            piece = self.stops.push(self.detok.push(t))
            if piece:
                yield piece
            if self.stops.stopped:
                self.finish_reason = "stop"
                self.engine.cancel(self.rid)
        if self.constraint is not None and not self.stops.stopped and not self.done:
            if self.constraint.done:  # nothing more may follow (ignore_eos would wait for a mask forever)
                self.engine.cancel(self.rid)
            else:
                self.engine.mask(self.rid, hex_mask(self.constraint))

    async def run(self) -> str:
        async for _ in self.pieces():
            pass
        return self.text


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, str]]:
    """(choice index, piece) of several choices as they come; (index, None) when one ends."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, c: Choice):
        try:
            async for piece in c.pieces():
                await q.put((i, piece))
            await q.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers with it
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        left = len(choices)
        while left:
            i, item = await q.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:
            c.cancel()
