"""Where the lower stage's time goes, phase by phase and XNNPACK pass by pass: ExecuTorch's stock lowering
(XnnpackPartitioner with the project's configs, every preprocess pass on every partition, the glue left as it is)
against ours (pipeline/backends/xnnpack: glue.py, lean_preprocess.py, the one-decomposition partitioner;
pipeline/exporters/lean_edge.py: one decomposition, the edge passes chained), on the
same exported program, in one run (a benchmark, not a test).

    python bench/lower_profile.py                       # the default build's export entry
    python bench/lower_profile.py recipe=gemma3_offgraph_8da4w
    python bench/lower_profile.py --only ours recipe=smollm2_custom

The program comes from the stage cache (export is built if missing). Each variant runs in a process of its own,
so peak RSS is its own. Prints seconds per phase, delegate calls and portable ops per forward, peak RSS, and
the ratio stock / ours.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import resource
import subprocess
import sys
import time

from common import ROOT, build  # noqa: E402  (bench/ is the script's folder)

PHASES = ("decompositions", "edge passes", "transform passes", "partition", "preprocess", "to_executorch", "serialize")


@contextlib.contextmanager
def timed(owner, name: str, phase: str, clock: dict):
    """Wrap owner.name so its (outermost) calls add to clock[phase]."""
    orig = getattr(owner, name)
    depth = [0]

    def wrapper(*a, **k):
        depth[0] += 1
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                clock[phase] += time.perf_counter() - t
    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def work(variant: str, program: str, overrides: list[str]) -> dict:
    import torch
    import torchao  # noqa: F401
    from executorch.backends.xnnpack import _passes
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.exir.program import _program

    import pipeline.compose  # noqa: F401  (registers the schemas, the recipes and the project_path resolver)
    import pipeline.model.cache_modes.custom  # noqa: F401  (the custom ops the program calls)
    import pipeline.model.cache_modes.offgraph  # noqa: F401
    from pipeline.backends import BACKENDS
    from pipeline.backends.xnnpack import weight_only
    from pipeline.exporters.native import delegation_report
    from pipeline.runtimes.executorch import load_kernels
    from tests.helpers import compose_cfg
    load_kernels()
    cfg = compose_cfg(*overrides)
    backend = BACKENDS["xnnpack"]
    ours = variant == "ours"
    _, passes = backend.partition()
    if not ours:
        passes = [p for p in passes if p.__name__ != "delegable_glue"]
        partitioner = XnnpackPartitioner(configs=weight_only.configs(), enable_bf16=True)
    else:
        partitioner = weight_only.partitioner()
    clock: dict = collections.defaultdict(float)
    per_pass: dict = collections.defaultdict(float)
    orig_transform = _passes._transform

    def pass_timer(ep, p):
        t = time.perf_counter()
        try:
            return orig_transform(ep, p)
        finally:
            per_pass[type(p).__name__] += time.perf_counter() - t
    ep = torch.export.load(program)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(timed(torch.export.ExportedProgram, "run_decompositions", "decompositions", clock))
        stack.enter_context(timed(_program, "_generate_edge_program", "edge passes", clock))
        stack.enter_context(timed(_program.EdgeProgramManager, "transform", "transform passes", clock))
        stack.enter_context(timed(type(partitioner), "partition", "partition", clock))
        from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
        stack.enter_context(timed(XnnpackBackend, "preprocess", "preprocess", clock))
        _passes._transform = pass_timer
        stack.callback(setattr, _passes, "_transform", orig_transform)
        if ours:
            from pipeline.exporters.lean_edge import decompose_for, lean_edge
            stack.enter_context(lean_edge())
            stack.enter_context(backend.lowering())
            ep = decompose_for(ep, [partitioner])
        edge = to_edge_transform_and_lower(ep, partitioner=[partitioner], transform_passes=passes,
                                           compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                            _skip_dim_order=True))
        lowered = time.perf_counter()
        report = delegation_report(edge)
        t = time.perf_counter()
        et = edge.to_executorch(backend.executorch_config(cfg))
        clock["to_executorch"] = time.perf_counter() - t
    t = time.perf_counter()
    size = len(et.buffer)
    clock["serialize"] = time.perf_counter() - t
    total = time.perf_counter() - t0
    clock["other"] = (lowered - t0) - sum(clock[p] for p in PHASES[:5])
    return {"total": total, "phases": dict(clock), "passes": dict(per_pass), "pte_bytes": size,
            "delegate_calls": report["delegate_calls"], "portable_ops": report["portable_ops"],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="pipeline overrides selecting the build (default: the default build)")
    ap.add_argument("--only", choices=("stock", "ours"))
    ap.add_argument("--worker", choices=("stock", "ours"), help=argparse.SUPPRESS)
    ap.add_argument("--program", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(work(a.worker, a.program, a.overrides)))
        return
    m = build([*a.overrides, "run.until=export"])
    program = str(next(s for s in m["stages"] if s["name"] == "export")["path"]) + "/program.pt2"
    results = {}
    for variant in ([a.only] if a.only else ["stock", "ours"]):
        r = subprocess.run([sys.executable, __file__, "--worker", variant, "--program", program, *a.overrides],
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            sys.exit(f"{variant} failed:\n{r.stderr[-3000:]}")
        results[variant] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"[{variant}] {results[variant]['total']:.1f} s", flush=True)
    names = list(results)
    print(f"\nlowering {' '.join(a.overrides) or '(the default build)'}: seconds")
    print(f"  {'phase':<28}" + "".join(f"{n:>10}" for n in names))
    for phase in (*PHASES, "other"):
        print(f"  {phase:<28}" + "".join(f"{results[n]['phases'].get(phase, 0):>10.1f}" for n in names))
    print(f"  {'total':<28}" + "".join(f"{results[n]['total']:>10.1f}" for n in names))
    print("  preprocess passes (all partitions):")
    passes = sorted({p for n in names for p in results[n]["passes"]},
                    key=lambda p: -max(results[n]["passes"].get(p, 0) for n in names))
    for p in passes:
        print(f"    {p:<26}" + "".join(f"{results[n]['passes'].get(p, 0):>10.1f}" for n in names))
    for key in ("delegate_calls", "portable_ops", "peak_rss_mib", "pte_bytes"):
        print(f"  {key:<28}" + "".join(f"{results[n][key]:>10.0f}" for n in names))
    if len(names) == 2:
        print(f"  stock / ours: x{results['stock']['total'] / results['ours']['total']:.2f}")
    out = ROOT / "outputs" / "bench" / "lower_profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overrides": a.overrides, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
