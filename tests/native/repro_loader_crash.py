"""Reproduces the documented loader crash (native/README.md, "Known loader crashes"): damaged dims of a
non-constant XNNPACK tensor value make XNNPACK plan gigabytes of workspace (xnn_plan_memory, from
XNNExecutor::prepare_args on the first forward) and the process dies when the machine runs out of memory.

    python tests/native/repro_loader_crash.py [--pte og_llama.pte] [--range START:END --byte 0xA9]
                                              [--runner native/build/llm_batched_runner] [--limit-gb 4 | --unlimited]

Without --range it picks the largest activation of the program's XNNPACK graphs and overwrites its first dim
(4 bytes) so that the activation asks for about 90% of the machine's memory: more than is free, less than the
kernel refuses outright (with the default heuristic overcommit a request beyond RAM + swap fails cleanly, which
is why a random damage only crashes in that window). It writes the damaged copy to /tmp and runs the runner on
it: by default under an address-space limit (RLIMIT_AS, --limit-gb), where XNNPACK's allocation fails cleanly
(xnn_status_out_of_memory -> exit 1); with --unlimited the allocation succeeds, XNNPACK writes into it and the
kernel's OOM killer ends the process (SIGKILL). --range/--byte damage any other bytes. Default program: the tiny
off-graph Llama of the native tests (og_llama.pte).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pte_layout  # noqa: E402

REPO = HERE.parent.parent


def default_pte() -> Path:
    found = sorted((Path.home() / ".cache" / "llm-pipeline" / "native-tests").glob("og-*/og_llama.pte"))
    if not found:
        sys.exit("no og_llama.pte in ~/.cache/llm-pipeline/native-tests: run `pytest tests/native -k batched` "
                 "once, or pass --pte")
    return found[-1]


def largest_activation(data: bytes) -> tuple[int, list[int]]:
    """(file offset of its first dim, its dims) for the non-constant XNNPACK value with the most elements."""
    best = None
    for start, g, _, tensor in pte_layout.xnnpack_values(data):
        dims = tensor.vector(2)
        if not dims or dims[0] == 0 or tensor.scalar(3, "<I") != 0:
            continue
        values = [int.from_bytes(g[dims[1] + 4 * k:dims[1] + 4 * k + 4], "little") for k in range(dims[0])]
        n = 1
        for v in values:
            n *= v
        if best is None or n > best[0]:
            best = (n, start + dims[1], values)
    if best is None:
        sys.exit("the program has no XNNPACK activation with dims")
    return best[1], best[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pte", type=Path)
    ap.add_argument("--range", help="START:END file offsets to overwrite (default: byte 2 of the first dim of "
                                    "the largest XNNPACK activation)")
    ap.add_argument("--byte", type=lambda s: int(s, 0), default=0xA9)
    ap.add_argument("--runner", type=Path, default=REPO / "native" / "build" / "llm_batched_runner")
    ap.add_argument("--limit-gb", type=float, default=4.0)
    ap.add_argument("--unlimited", action="store_true", help="no address-space limit: expect the OOM killer")
    a = ap.parse_args()

    pte = a.pte or default_pte()
    data = bytearray(pte.read_bytes())
    inside = lambda pos: any(s <= pos < e for s, e in pte_layout.activation_dims_ranges(bytes(data)))  # noqa: E731
    if a.range:
        start, end = (int(x, 0) for x in a.range.split(":"))
        data[start:end] = bytes([a.byte]) * (end - start)
        print(f"bytes [{start}, {end}) set to {a.byte:#04x} (inside the documented range: {inside(start)})")
    else:
        start, dims = largest_activation(bytes(data))
        rest = 4  # fp32 bytes per element times the other dims
        for v in dims[1:]:
            rest *= v
        first = int(0.9 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // rest
        print(f"largest XNNPACK activation: dims {dims}, first dim at byte {start} "
              f"(inside the documented range: {inside(start)})")
        data[start:start + 4] = first.to_bytes(4, "little")
        print(f"first dim set to {first}: the activation asks for {first * rest / 2**30:.1f} GiB")
    out = Path("/tmp") / f"damaged_{start}_{pte.name}"
    out.write_bytes(data)
    print(f"damaged copy: {out}")

    argv = [str(a.runner), "--pte", str(out), "--max-new-tokens", "2", "--threads", "1"]
    argv += ["--ids", "1,2,3"] if "batched" in a.runner.name else ["--kv-max-capacity", "64", "--prompt-ids", "1,2,3"]

    def limit():
        if not a.unlimited:
            n = int(a.limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (n, n))

    print("running:", " ".join(argv), "(no memory limit)" if a.unlimited else f"(RLIMIT_AS {a.limit_gb} GB)")
    proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", preexec_fn=limit)
    tail = [ln for ln in proc.stderr.splitlines() if "executorch E" in ln or ln.startswith("error")]
    print("\n".join(tail[-6:]))
    print(f"exit {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
