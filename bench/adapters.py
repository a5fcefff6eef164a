"""Fine-tunes kept apart against merged: two PEFT LoRA adapters of SmolLM2-135M-Instruct, each built merged
(model.adapter_mode=merge) and kept apart (separate) at the default recipe (a benchmark, not a test).

    python bench/adapters.py                    # rank 16 on every linear, verified builds
    python bench/adapters.py --rank 8 --targets q_proj,v_proj

The adapters are random (seeded), their updates a few percent of the weights' scale, as a fine-tune's are. Prints:
- bytes on disk of the two programs each way (the two adapter programs share one foundation.ptd: counted once);
- resident memory of one process that loads both programs and runs a forward on each (native/build/adapter_memory),
  with XNNPACK's weight cache off and on (on: packed weights are kept once per data key, so programs over one
  foundation share theirs): RSS, and PSS (a file page both programs' loaders map counts once);
and the ratios kept-apart / merged. Writes outputs/bench/adapters.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from common import ROOT, build, write_results  # noqa: E402  (bench/ is the script's folder)

MEMORY = ROOT / "native" / "build" / "adapter_memory"


def make_adapters(model_dir: Path, out: Path, rank: int, targets, n: int = 2) -> list[Path]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM
    paths = []
    for i in range(n):
        path = out / f"rank{rank}-{'-'.join(targets) if isinstance(targets, list) else targets}-{i}"
        if not (path / "adapter_config.json").exists():
            torch.manual_seed(100 + i)
            config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights="gaussian")
            tuned = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
            with torch.no_grad():  # PEFT starts B at zero (no update): a trained-looking B instead
                for name, p in tuned.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.02 / rank ** 0.5)
            tuned.save_pretrained(path)
        paths.append(path)
    return paths


def memory(ptes: list[Path], weight_cache: bool) -> list[dict]:
    args = [str(MEMORY), *(["--weight-cache"] if weight_cache else []), *map(str, ptes)]
    r = subprocess.run(args, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def disk_bytes(files: list[Path]) -> int:
    """Bytes of these files, a file reached twice (a hard link) once."""
    seen = {}
    for f in files:
        seen[(f.stat().st_dev, f.stat().st_ino)] = f.stat().st_size
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all-linear", help="all-linear, or module names, comma-separated")
    ap.add_argument("--no-verify", action="store_true", help="skip the verify stage (it is on by default)")
    a = ap.parse_args()
    if not MEMORY.exists():
        raise SystemExit(f"{MEMORY} is missing: bash native/build.sh")
    targets = a.targets if a.targets == "all-linear" else a.targets.split(",")
    base = build(["model=smollm2", "run.until=download"])
    model_dir = Path(next(s["path"] for s in base["stages"] if s["name"] == "download")) / "model"
    adapters = make_adapters(model_dir, ROOT / "outputs" / "bench" / "adapters", a.rank, targets)
    results: dict = {"rank": a.rank, "targets": a.targets, "modes": {}}
    for mode in ("merge", "separate"):
        runs = [build(["model=smollm2", f"model.adapter={p}", f"model.adapter_mode={mode}"], verify=not a.no_verify)
                for p in adapters]
        lowered = [Path(next(s["path"] for s in m["stages"] if s["name"] == "lower")) for m in runs]
        ptes = [d / "model.pte" for d in lowered]
        files = ptes + [f for d in lowered for f in d.glob("*.ptd")]
        results["modes"][mode] = {
            "stage_keys": [{s["name"]: s["key"][:12] for s in m["stages"]} for m in runs],
            "pte_bytes": [p.stat().st_size for p in ptes],
            "data_bytes": {f.name: f.stat().st_size for f in files if f.suffix == ".ptd"},
            "disk_bytes": disk_bytes(files),
            "memory": {"weight_cache_off": memory(ptes, False), "weight_cache_on": memory(ptes, True)},
        }
    merged, apart = results["modes"]["merge"], results["modes"]["separate"]
    mib = 2 ** 20
    print(f"\ntwo fine-tunes of SmolLM2-135M (LoRA rank {a.rank}, {a.targets}), default recipe")
    print(f"{'':34}{'merged':>12}{'kept apart':>12}{'ratio':>8}")
    print(f"{'program files (MiB)':34}{sum(merged['pte_bytes']) / mib:12.1f}{sum(apart['pte_bytes']) / mib:12.1f}")
    print(f"{'foundation.ptd, once (MiB)':34}{0:12.1f}{sum(apart['data_bytes'].values()) / mib:12.1f}")
    print(f"{'on disk, both (MiB)':34}{merged['disk_bytes'] / mib:12.1f}{apart['disk_bytes'] / mib:12.1f}"
          f"{apart['disk_bytes'] / merged['disk_bytes']:8.2f}")
    for cache in ("weight_cache_off", "weight_cache_on"):
        m, s = merged["memory"][cache], apart["memory"][cache]
        print(f"XNNPACK weight cache {cache.split('_')[-1]}:")
        for measure in ("rss_mib", "pss_mib"):
            name = measure.split("_")[0].upper()
            for label, k in (("first program", 1), ("both programs", 2)):
                print(f"{f'  {name}, {label} (MiB)':34}{m[k][measure]:12.1f}{s[k][measure]:12.1f}"
                      f"{s[k][measure] / m[k][measure]:8.2f}")
            print(f"{f'  {name}, the second adds (MiB)':34}{m[2][measure] - m[1][measure]:12.1f}"
                  f"{s[2][measure] - s[1][measure]:12.1f}")
    write_results("adapters", results)


if __name__ == "__main__":
    main()
