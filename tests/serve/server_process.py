"""`python -m pipeline.serve` in a process of its own on 127.0.0.1 (a free port), as a user starts it, with its log
kept for the tests to read."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 180):
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.serve", "--host", "127.0.0.1", "--port", "0",
                                      *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.log: list[str] = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r" on (http://127\.0\.0\.1:\d+)/v1 ", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-40:]))

    @property
    def text(self) -> str:
        return "".join(self.log)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.1)
        return self.proc.returncode
