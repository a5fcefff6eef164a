"""The C++ batched engine as a child process: `llm_batched_runner --serve`, JSON lines both ways
(native/src/batched/serve_loop.h). One reader task hands each request's events to its own queue."""
from __future__ import annotations

import asyncio
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class EngineError(RuntimeError):
    """The engine could not start, or has exited."""


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    speculate: bool = True
    ignore_eos: bool = False


class Engine:
    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.info: dict = {}
        self.streams: dict[int, asyncio.Queue] = {}
        self.ids = itertools.count(1)
        self.stats_waiters: list[asyncio.Future] = []
        self.alive = False
        self.tasks: list[asyncio.Task] = []
        self.stderr_tail: list[str] = []

    async def start(self) -> dict:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=1 << 26)
        self.tasks.append(asyncio.create_task(self._log()))
        line = await self.proc.stdout.readline()
        if not line:
            await self.proc.wait()
            await asyncio.sleep(0.1)  # the last of stderr
            raise EngineError(f"the engine did not start (exit {self.proc.returncode}): "
                              + " | ".join(self.stderr_tail[-5:]))
        self.info = json.loads(line)
        self.alive = True
        self.tasks.append(asyncio.create_task(self._read()))
        return self.info

    async def _log(self) -> None:
        """The engine's stderr (its setup report and warnings) onto the server's, prefixed."""
        async for raw in self.proc.stderr:
            text = raw.decode(errors="replace").rstrip()
            self.stderr_tail = (self.stderr_tail + [text])[-20:]
            print(f"[engine] {text}", file=sys.stderr, flush=True)

    async def _read(self) -> None:
        async for line in self.proc.stdout:
            ev = json.loads(line)
            kind, rid = ev.get("ev"), ev.get("id")
            if kind == "stats":
                if self.stats_waiters:
                    self.stats_waiters.pop(0).set_result(ev)
            elif rid in self.streams:
                if kind == "error":  # a request the engine refused: it ends here
                    ev = {"ev": "done", "id": rid, "reason": "error", "error": ev.get("message")}
                    self._send({"op": "cancel", "id": rid})
                self.streams[rid].put_nowait(ev)
                if ev["ev"] == "done":
                    del self.streams[rid]
            elif kind == "error" and rid is None:
                print(f"[engine] refused a line: {ev.get('message')}", file=sys.stderr, flush=True)
        self.alive = False
        for rid, q in list(self.streams.items()):  # nothing more will come for them
            q.put_nowait({"ev": "done", "id": rid, "reason": "error", "error": "the engine exited"})
        self.streams.clear()
        for w in self.stats_waiters:
            w.set_exception(EngineError("the engine exited"))

    def _send(self, obj: dict) -> None:
        if not self.alive:
            raise EngineError("the engine has exited")
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())

    def submit(self, ids: list[int], s: Sampling, mask: Optional[str] = None) -> tuple[int, asyncio.Queue]:
        """A request's id and the queue of its events ("tokens", then "done")."""
        rid = next(self.ids)
        msg = {"op": "submit", "id": rid, "ids": ids, "max_tokens": s.max_tokens, "temperature": s.temperature,
               "top_p": s.top_p, "top_k": s.top_k, "speculate": s.speculate, "ignore_eos": s.ignore_eos}
        if s.seed is not None:
            msg["seed"] = s.seed
        if mask is not None:
            msg["mask"] = mask
        q: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = q
        self._send(msg)
        return rid, q

    def mask(self, rid: int, mask: str) -> None:
        if rid in self.streams:
            self._send({"op": "mask", "id": rid, "mask": mask})

    def cancel(self, rid: int) -> None:
        if rid in self.streams and self.alive:
            self._send({"op": "cancel", "id": rid})

    async def stats(self) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        self._send({"op": "stats"})
        return await asyncio.wait_for(fut, 10)

    async def close(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for t in self.tasks:
            t.cancel()


def engine_argv(binary: Path, pte: Path, tokenizer: Optional[Path], *, sessions: int, prefix_entries: int,
                speculate: bool, threads: int, max_session_tokens: int = 0, chat: Optional[str] = None) -> list[str]:
    argv = [str(binary), "--serve", "--pte", str(pte), "--max-decode-sequences", str(sessions),
            "--prefix-cache-entries", str(prefix_entries), "--threads", str(threads),
            "--max-session-tokens", str(max_session_tokens)]
    if tokenizer is not None:  # the chat template's turn end becomes a stop token
        argv += ["--tokenizer", str(tokenizer)]
    if speculate:
        argv += ["--speculate", "ngram"]
    if chat is not None:  # a built-in template's turn end is a stop token too
        argv += ["--chat", chat]
    return argv
