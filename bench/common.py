"""What the benchmarks share: a pipeline build through the stage cache, and the GGUF file a model came from."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's pipeline, whatever `pip install -e` points at


def build(overrides: list[str], verify: bool = False) -> dict:
    """`python -m pipeline OVERRIDES` (verify off unless asked); returns the run manifest, exits on failure."""
    extra = [] if verify else ["verify.enabled=false"]
    r = subprocess.run([sys.executable, "-m", "pipeline", *overrides, *extra, "run.progress=false"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"build {' '.join(overrides)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(Path(r.stdout.strip().splitlines()[-1].split(": ", 1)[1]).read_text())


def write_results(name: str, results) -> Path:
    """outputs/bench/<name>.json, and says where."""
    out = ROOT / "outputs" / "bench" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return out


def gguf_file(m: dict) -> Path:
    """The GGUF the model came from (assembled once into outputs/bench/ when shipped in chunks)."""
    from omegaconf import OmegaConf

    from pipeline.model import sources
    model = OmegaConf.create(m["config"]["model"])
    path, _, assemble = sources.gguf_location(model)
    if path is not None:
        return path
    out = ROOT / "outputs" / "bench" / "gguf" / f"{model.name}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp.gguf")
        Path(assemble(tmp)).replace(out)
    return out
