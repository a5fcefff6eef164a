"""How close an XNNPACK 8da4w / 8da8w program is to torchao's eager module, to torchao with bf16 group scales, and to
pipeline/backends/xnnpack/numerics.py's reference; and the float-op floor those can reach.

    python bench/xnnpack_numerics.py recipe=tiny_llama_xnnpack_8da4w
    python bench/xnnpack_numerics.py recipe=smollm2_xnnpack_8da4w --tokens 128 --sequences 1
    python bench/xnnpack_numerics.py --manifest outputs/runs/<time>/manifest.json

Teacher-forced over random token ids (a prefill of 8, then one token per step). Figures: max |dlogit|, mean KLD
(program against each eager module), top-1 agreement. The floor row is the reference against itself with +-1 ulp of
random error in the RMSNorm, SiLU and attention outputs (where XNNPACK's own rsqrt / sigmoid / softmax / sin / cos
kernels run): the residual no emulation of the linears alone can remove.
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from common import build

PREFILL = 8


def steps(module, ids: list[int], chunk: int) -> torch.Tensor:
    from pipeline.runtimes.base import run_sequence
    out = [run_sequence(module, ids[:PREFILL], chunk)]
    out += [run_sequence(module, [t], 1, start=PREFILL + i) for i, t in enumerate(ids[PREFILL:])]
    return torch.stack(out)


def figures(ref: torch.Tensor, got: torch.Tensor) -> dict:
    kld = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return {"max": (ref - got).abs().max().item(), "kld": kld.mean().item(),
            "top1": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def bf16_scales(module):
    """torchao's module with only its 4-bit group scales rounded to bf16 (what ExecuTorch serializes)."""
    from pipeline.backends.xnnpack.numerics import dynamic_weight
    out = copy.deepcopy(module)
    with torch.no_grad():
        for m in out.modules():
            w = dynamic_weight(m)
            if w is not None and w.target_dtype == torch.int4:
                w.scale.copy_(w.scale.to(torch.bfloat16).float())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("overrides", nargs="*", help="pipeline overrides (a build up to lower)")
    p.add_argument("--manifest", type=Path, help="a run manifest instead of a build")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--sequences", type=int, default=8)
    a = p.parse_args()
    m = json.loads(a.manifest.read_text()) if a.manifest else build([*a.overrides, "run.until=lower"])
    paths = {s["name"]: s.get("path") for s in m["stages"]}
    from pipeline import abi
    from pipeline.backends.xnnpack.numerics import reference
    from pipeline.model.quant.float_noise import with_float_noise
    from pipeline.runtimes import open_program
    eager = torch.load(Path(paths["quantize"]) / "module.pt", weights_only=False)
    program = open_program(Path(paths["lower"]))
    ref = reference(eager)
    modules = {"torchao": eager, "torchao + bf16 group scales": bf16_scales(eager), "reference": ref,
               "floor": with_float_noise(ref)}
    chunk = m["config"]["export"]["prefill_chunk"]
    vocab = abi.ints(program.constant(abi.VOCAB_SIZE))[0]
    runs = {k: [] for k in ("program", *modules)}
    for seed in range(a.sequences):
        ids = torch.randint(3, vocab, (a.tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
        program.reset()
        runs["program"].append(steps(program, ids, chunk))
        for k, module in modules.items():
            runs[k].append(steps(module, ids, chunk))
    got, ref_logits = torch.cat(runs["program"]), torch.cat(runs["reference"])
    print(f"{m.get('recipe')} {' '.join(m.get('overrides', []))}: {got.shape[0]} steps")
    print("| against | max abs dlogit | mean KLD | top-1 |\n|---|---|---|---|")
    for k in modules:
        f = figures(torch.cat(runs[k]), ref_logits if k == "floor" else got)
        print(f"| {'reference vs noisy reference (floor)' if k == 'floor' else 'program vs ' + k} | "
              f"{f['max']:.4g} | {f['kld']:.3g} | {f['top1']:.3f} |")


if __name__ == "__main__":
    main()
