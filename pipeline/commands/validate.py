"""Check every recipe without downloading or building anything (or, with --smoke, build each on a tiny model).

    python -m pipeline validate [DIR]           # composition, every rule, preflight, memory estimate: one table
    python -m pipeline validate --smoke         # also build each recipe end to end on a tiny random model

The rules themselves are pipeline/preflight.py; this module is only the command.
"""
from __future__ import annotations

from typing import Optional

from omegaconf import OmegaConf

from pipeline.config import Thresholds
from pipeline.errors import ConfigError, PipelineError
from pipeline.model import archs, sources
from pipeline.model.geometry import Geometry
from pipeline.memory_estimate import memory_estimate
from pipeline.preflight import check

# the tiny model of an architecture: its own config group where it has one, else tiny_llama's dims with the
# architecture's entry (model.random.arch: pipeline/model/archs/<model_type>.py `tiny`)
# a hub recipe whose config.json is neither reachable nor in the local hub cache: every rule that does not need
# its geometry was checked; the table says so (status `hub`) instead of failing a machine without network
NEEDS_HUB = "not in the local hub cache"


def hub_offline_unless_reachable(timeout: float = 3.0) -> bool:
    """One probe of the hub's host; without an answer the hub client goes offline (local cache only), so no
    recipe waits on its retries. Returns whether the hub is reachable."""
    import socket
    from urllib.parse import urlparse

    import huggingface_hub.constants as hc
    host = urlparse(hc.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        hc.HF_HUB_OFFLINE = True
        return False


def _compose(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    from pipeline.paths import CONF_DIR
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[f"recipe={name}", *overrides])


def validate_recipe(name: str, total_bytes: int) -> tuple[list[tuple[str, object, str]], Optional[dict], Optional[Geometry]]:
    """Problems (composition, every rule, preflight incl. memory) and the memory estimate of one recipe."""
    try:
        cfg = _compose(name)
    except Exception as e:  # composition: unknown key, bad group option, bad enum value ...
        detail = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
        return [("(composition)", name, detail[:400])], None, None
    try:
        g = check(cfg, total_bytes=total_bytes)  # the memory rule included
        problems = []
    except ConfigError as e:
        problems, g = list(e.problems), None
        try:
            g = sources.geometry(cfg.model)
        except PipelineError:
            pass
    return problems, memory_estimate(cfg, g) if g is not None else None, g


def smoke(name: str, g: Geometry) -> Optional[str]:
    """Builds the recipe end to end on a tiny random model of the same architecture; None if it passed."""
    from pipeline.session import build
    tiny = archs.ARCHS[g.arch].tiny_model
    # random weights: what quantization costs against float means nothing here, so only the program's
    # fidelity to the eager model of the same quantization (same_quant) is gated
    cfg = _compose(name, f"model={tiny}", f"model.random.arch={g.arch}", "export.max_context_len=64",
                   "export.prefill_chunk=8", "verify.max_new_tokens=8", "run.progress=false")
    for gate in ("exact", "dynamic"):
        cfg.verify[gate].vs_float = OmegaConf.structured(Thresholds)
    try:
        m = build(cfg, recipe=f"{name} (smoke on {tiny})")
    except PipelineError as e:
        return str(e).splitlines()[0]
    return None if m["status"] == "ok" else f"status {m['status']}"


def main(argv=None) -> int:
    import argparse

    import psutil

    from pipeline.config import register_configs
    from pipeline.recipes import recipe_files, register_recipes

    ap = argparse.ArgumentParser(prog="python -m pipeline validate",
                                 description="Check every recipe (composition, rules, preflight, memory) "
                                             "without downloading or building anything.")
    ap.add_argument("dir", nargs="?", default=None,
                    help="recipe folder (default: recipes/ and the tests' tests/recipes/)")
    ap.add_argument("--smoke", action="store_true",
                    help="also build each recipe end to end on a tiny random model of its architecture")
    a = ap.parse_args(argv)
    from pathlib import Path
    root = None if a.dir is None else Path(a.dir).resolve()
    if root is not None and not root.is_dir():
        print(f"error: {a.dir}: not a folder", flush=True)
        return 2
    register_configs()
    names = register_recipes(root)
    files = recipe_files(root)
    if not names:
        print(f"error: no *.yaml recipes under {root or 'recipes/'}")
        return 2
    total = psutil.virtual_memory().total
    rows, bad, hub = [], 0, 0
    hub_offline_unless_reachable()
    for name in names:
        problems, est, g = validate_recipe(name, total)
        if problems and all(NEEDS_HUB in why for _, _, why in problems):
            hub += 1
            rows.append((name, [], None, "hub"))
            continue
        if "hydra" in OmegaConf.load(files[name]):  # where files are written is not a recipe's to decide
            problems.insert(0, ("hydra", "...", "a recipe may not set Hydra's own settings (run/sweep dirs, callbacks)"))
        if a.smoke and not problems and g is not None:
            why = smoke(name, g)
            if why:
                problems.append(("(smoke)", name, why))
        bad += bool(problems)
        rows.append((name, problems, est, "FAIL" if problems else "ok"))
    w = max(len(n) for n in names)
    print(f"{'recipe':<{w}}  {'status':<6}  {'peak RSS':>11}  {'KV cache':>9}  problems")
    for name, problems, est, status in rows:
        exp = f"{est['peak_bytes'] / 2**30:.1f} GiB" if est else "-"
        kv = f"{est['kv_cache_bytes'] / 2**20:.1f} MiB" if est else "-"
        first = True
        for key, value, why in problems or [("", "", "")]:
            head = f"{name:<{w}}  {status:<6}  {exp:>11}  {kv:>9}" if first else " " * (w + 33)
            note = "config.json unreachable: checked all but the geometry rules" if status == "hub" else ""
            print(f"{head}  {f'{key}={value!r}: {why}' if key else note}")
            first = False
    print(f"\n{len(rows)} recipe(s), {bad} with problems" + (f", {hub} need the hub for their geometry" if hub else ""))
    return 1 if bad else 0
