"""Progress display for long steps that report no progress of their own (loading, export, lowering)."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def spinner(desc: str, enabled: bool = True):
    """An elapsed-time bar that ticks while the body runs."""
    if not enabled or not sys.stderr.isatty():
        yield  # a log file gets no ticking bar; the stage's log line has its time
        return
    bar = tqdm(desc=desc, total=None, bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False)
    stop = threading.Event()

    def tick():
        while not stop.wait(0.5):
            bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        bar.close()


def bar(iterable=None, desc: str = "", total=None, enabled: bool = True):
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False,
                disable=not enabled or not sys.stderr.isatty())
