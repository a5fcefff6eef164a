"""A server started as a child process (this one, or another engine's for a benchmark): its stderr kept, ready once a
line matches a pattern (which names its URL), stopped with SIGTERM (SIGKILL after 30 s)."""
from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path
from typing import Optional

READY = r" on (http://127\.0\.0\.1:\d+)/v1 "  # python -m pipeline.serve's line once it listens (__main__.serve)


class ChildServer:
    def __init__(self, argv: list[str], pattern: str = READY, cwd: Optional[Path] = None, timeout: float = 180):
        self.proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.log: list[str] = []
        self.match: Optional[re.Match] = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                if self.match is None:
                    self.match = re.search(pattern, line)
                    if self.match:
                        ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.match is None:
            self.stop()
            raise RuntimeError(f"{argv[0]} did not start:\n" + "".join(self.log[-40:]))

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
        return self.proc.returncode
