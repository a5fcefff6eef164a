"""Which build `python -m pipeline generate` runs: --run, --pte, or a recipe's latest build as composed (the
default's unless --recipe), found by the `composition` hash each run manifest records (pipeline/session.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from pipeline import paths


def composition(recipe: str = "default", overrides: tuple[str, ...] = ()) -> str:
    """The hash a build of `recipe` as composed, with `overrides` (none that leave its program as it is), records in
    its manifest."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.compose import compose
    from pipeline.session import build_hash
    try:
        return build_hash(compose(([] if recipe == "default" else [f"recipe={recipe}"]) + list(overrides)))
    except (HydraException, OmegaConfBaseException) as e:  # an unknown recipe, a file that does not compose
        raise SystemExit(f"error: --recipe {recipe}: {str(e).splitlines()[0]}") from None


def latest_run(recipe: str = "default", root: Path = paths.OUTPUTS_ROOT, overrides: tuple[str, ...] = (),
               required: bool = True) -> Optional[Path]:
    """The newest run manifest of a successful build of `recipe` as composed (with `overrides`), whose program is
    still there (gc may have taken older ones): not a sweep's point, a test's tiny model or a build with other
    overrides. None if there is none and not `required`."""
    want = composition(recipe, overrides)
    for m in sorted((root / "runs").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            run = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        if (run.get("status") == "ok" and run.get("composition") == want and run.get("pte")
                and run.get("model_dir") and Path(run["pte"]).exists()):
            return m
    if not required:
        return None
    build = "python -m pipeline" + ("" if recipe == "default" else f" recipe={recipe}")
    raise SystemExit(f"error: no successful build of recipe {recipe} as composed under {root / 'runs'}: run "
                     f"`{build}` first, or give --run / --pte (another build) or --recipe NAME (another recipe's)")


def resolve(args) -> tuple[Path, Optional[Path], Optional[Path]]:
    """(the program's file, model dir, tokenizer.json) from --run, --pte or a recipe's latest build (the default's
    unless --recipe), which is named on stderr."""
    if args.pte:
        return Path(args.pte), args.model_dir and Path(args.model_dir), args.tokenizer and Path(args.tokenizer)
    path = Path(args.run) if args.run else latest_run(args.recipe or "default")
    manifest = path / "manifest.json" if path.is_dir() else path
    run = json.loads(manifest.read_text())
    if run.get("status") != "ok" or not run.get("pte"):
        raise SystemExit(f"error: --run {path}: not a successful build (status {run.get('status')!r})")
    extra = " ".join(o for o in run.get("overrides") or [] if not o.startswith("recipe="))
    print(f"[build] {manifest.parent} (recipe {run.get('recipe')}{', ' + extra if extra else ''}; build "
          f"{run.get('build_hash')}, {run.get('started')})", file=sys.stderr)
    return Path(run["pte"]), Path(run["model_dir"]), None
