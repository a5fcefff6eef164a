"""`python -m pipeline.serve` in a process of its own on 127.0.0.1 (a free port), as a user starts it, with its log
kept for the tests to read."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from pipeline.serve.child import ChildServer

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess(ChildServer):
    def __init__(self, *args: str, timeout: float = 180):
        super().__init__([sys.executable, "-m", "pipeline.serve", "--host", "127.0.0.1", "--port", "0", *args],
                         cwd=ROOT, timeout=timeout)
        self.url = self.match.group(1)

    def stop(self) -> int:
        code = super().stop()
        time.sleep(0.1)  # the reader thread's last lines
        return code
