"""`quantize.target_bpw`: each linear's scheme from its measured sensitivity, for the least total KLD at a file size.

- Sensitivity (the calibrate stage, `sensitivities`): for each linear the plan may move and each scheme the backend
  offers it (its PLAN_CANDIDATES), the KLD of the float model with that one linear quantized against the float model,
  over positions of the calibration set (pipeline/corpus.py, never scored).
- Allocation (the quantize stage, `allocate`): every linear starts at its cheapest candidate; then, while the
  program's predicted bits/weight stay within the target, the upgrade that saves the most KLD per extra bit is taken.
  The predicted KLD is the sum of the chosen costs: each was measured alone, and small costs add, to first order.
- The plan lands in quantize.json with each linear's scheme and cost, and as `quantize.overrides` a recipe can hold.
File bits per weight: the weight's bits plus its scale's per group (the backend's SCALE_BITS); the embedding at its
scheme, the rest of the parameters fp32. Which linears the plan moves is pipeline/model/quant/resolve.py's.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pipeline.model.quant import resolve
from pipeline.model.quant.schemes import SCHEMES
from pipeline.registry import v

# `backend` below is the backend's module (pipeline/backends): its PLAN_CANDIDATES, the (scheme, group) the allocator
# may give a linear, cheapest first (a group that does not divide a linear's inputs is not offered to it), and its
# SCALE_BITS, what its file keeps per group and per row
# the sensitivity pass runs one batched forward a (linear, scheme) over ROW_TOKENS tokens of each calibration domain
# (one row each, so every domain weighs in), comparing the logits of each row's second half: 630 forwards on
# SmolLM2 (210 linears, 3 schemes)
ROW_TOKENS = 64


def file_bits(scheme: str, group: int, n_in: int, backend) -> float:
    """Bits a weight of `scheme` takes in the backend's program file (pipeline/model/quant/schemes.py)."""
    return SCHEMES[scheme].file_bits(group, n_in, backend.SCALE_BITS)


def _kld(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), -1)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def _layer_of(model: nn.Module, name: str) -> Optional[tuple[nn.ModuleList, int]]:
    """(the decoder's layer list, the index) of the layer holding linear `name`, or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            parent = model.get_submodule(".".join(parts[:i]))
            if isinstance(parent, nn.ModuleList):
                return parent, int(parts[i])
    return None


def trial_ids(rows: list[list[int]]) -> torch.Tensor:
    """The sensitivity pass's batch: the first ROW_TOKENS tokens of each row (a calibration domain's), cut to the
    shortest."""
    n = min(ROW_TOKENS, *map(len, rows))
    return torch.tensor([r[:n] for r in rows])


def sensitivities(model: nn.Module, rows: list[list[int]], names: list[str], candidates, algorithm: str,
                  progress=None) -> dict[str, dict[str, float]]:
    """name -> {"scheme gGROUP": KLD with that linear alone quantized so}, on the float (smoothed) HF model, over
    `rows` (token ids, a row per calibration domain, batched by trial_ids). The layers before the linear's own replay
    their float outputs (a layer's output does not depend on what comes after it), so a trial computes only the
    layers from its linear's on."""
    from pipeline.model.quant.apply import quantize_one, torchao_config
    ids = trial_ids(rows)
    keep = torch.arange(ids.shape[1] // 2, ids.shape[1])
    outputs: dict[int, object] = {}
    layer_lists = {id(hit[0]): hit[0] for hit in (_layer_of(model, n) for n in names) if hit}
    hooks = [layer.register_forward_hook(lambda m, a, out, key=id(layer): outputs.__setitem__(key, out))
             for layers in layer_lists.values() for layer in layers]
    with torch.no_grad():
        try:
            ref = torch.log_softmax(model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits.float(), -1)
        finally:
            for h in hooks:
                h.remove()
        out = {}
        for i, name in enumerate(names):
            module, hit = model.get_submodule(name), _layer_of(model, name)
            replayed = [] if hit is None else [hit[0][j] for j in range(hit[1])]
            for layer in replayed:  # an instance attribute shadows the class's forward for this trial only
                layer.forward = lambda *a, _out=outputs[id(layer)], **k: _out
            original, out[name] = module.weight, {}
            try:
                for scheme, group in candidates:
                    if group and module.weight.shape[1] % group:
                        continue
                    quantize_one(model, name, torchao_config(scheme, group, algorithm))
                    logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
                    out[name][f"{scheme} g{group}"] = _kld(ref, logits)
                    module.weight = original
            finally:
                for layer in replayed:
                    del layer.forward
            if progress:
                progress(i + 1, len(names))
    return out


def allocate(costs: dict[str, dict[str, float]], shapes: dict[str, tuple[int, int]], fixed_bits: float,
             params: int, target_bpw: float, backend) -> dict:
    """The plan: each linear's (scheme, group) for the least summed KLD within target_bpw (file bits over params,
    `fixed_bits` being what the rest of the program takes)."""
    options = {}
    for name, by in costs.items():
        n_out, n_in = shapes[name]
        opts = []
        for key, kld in by.items():
            scheme, g = key.split(" g")
            opts.append((file_bits(scheme, int(g), n_in, backend) * n_out * n_in, kld, scheme, int(g)))
        options[name] = sorted(opts)
    choice = {name: 0 for name in options}
    budget = target_bpw * params - fixed_bits
    used = sum(options[n][0][0] for n in options)
    if used > budget:
        raise ValueError(f"quantize.target_bpw={target_bpw}: even every linear at its cheapest candidate takes "
                         f"{(used + fixed_bits) / params:.2f} bits/weight")
    while True:
        best: Optional[tuple] = None
        for name, opts in options.items():
            bits0, kld0 = opts[choice[name]][:2]
            for j in range(choice[name] + 1, len(opts)):
                extra, saved = opts[j][0] - bits0, kld0 - opts[j][1]
                if saved > 0 and used + extra <= budget and (best is None or saved / extra > best[0]):
                    best = (saved / extra, name, j, extra)
        if best is None:
            break
        _, name, j, extra = best
        choice[name], used = j, used + extra
    plan = {name: {"scheme": options[name][choice[name]][2], "group_size": options[name][choice[name]][3],
                   "kld": options[name][choice[name]][1]} for name in options}
    return {"target_bpw": target_bpw, "predicted_bpw": (used + fixed_bits) / params,
            "predicted_kld": math.fsum(p["kld"] for p in plan.values()), "linears": plan,
            "by_scheme": _count(plan)}


def _count(plan: dict) -> dict:
    out: dict[str, int] = {}
    for p in plan.values():
        key = f"{p['scheme']} g{p['group_size']}"
        out[key] = out.get(key, 0) + 1
    return out


def overrides(plan: dict, base: tuple[str, int]) -> list[dict]:
    """The plan as quantize.overrides entries (by exact name) for the linears off the base scheme."""
    return [{"pattern": name, "scheme": p["scheme"], "group_size": p["group_size"]}
            for name, p in plan["linears"].items() if (p["scheme"], p["group_size"]) != base]


def snippet(plan: dict, base: tuple[str, int]) -> str:
    """A recipe fragment that builds this plan without measuring again."""
    lines = ["quantize:", f"  linear: {base[0]}", f"  linear_group_size: {base[1]}", "  target_bpw: null",
             "  overrides:"]
    lines += [f"    - {{pattern: '{o['pattern']}', scheme: {o['scheme']}, group_size: {o['group_size']}}}"
              for o in overrides(plan, base)]
    return "\n".join(lines)


def cheapest_bits(n_in: int, backend) -> float:
    """File bits of the cheapest candidate the backend offers a linear of n_in inputs."""
    return min(file_bits(s, g, n_in, backend) for s, g in backend.PLAN_CANDIDATES if not g or n_in % g == 0)


def smallest_bpw(q, g, params: int, embedding: int, backend) -> float:
    """The least file bits/weight quantize.target_bpw can reach on a geometry (preflight asks before any download):
    each linear the plan may move at its cheapest candidate, the rest at what resolve gives them."""
    bits, covered = embedding * file_bits(*resolve.embedding(q).pair, g.hidden_size, backend), embedding
    for name, (n_out, n_in, role) in g.linear_specs().items():
        if name == "lm_head" and g.tie_word_embeddings:
            continue
        choice = resolve.linear(q, name, role, head=name == "lm_head")
        movable = choice.movable and name != "lm_head"
        per = cheapest_bits(n_in, backend) if movable else file_bits(*choice.pair, n_in, backend)
        bits, covered = bits + per * n_out * n_in, covered + n_out * n_in
    return (bits + 32.0 * max(params - covered, 0)) / params


def target_problems(q, g, params: int, embedding: int, backend) -> list[tuple]:
    """Preflight's check that the cheapest plan reaches quantize.target_bpw (its range and backend are checked
    apart): (key, value, what is allowed)."""
    if q.target_bpw is None or not backend.PLAN_CANDIDATES or not 2 <= q.target_bpw <= 32:
        return []
    least = smallest_bpw(q, g, params, embedding, backend)
    cheapest = "{} g{}".format(*backend.PLAN_CANDIDATES[0])
    return [] if least <= q.target_bpw else [("quantize.target_bpw", q.target_bpw, (
        f"every linear the plan may move at its cheapest scheme ({cheapest}), with the embedding at "
        f"{v(q.embedding)} and what quantize.overrides pin, takes {least:.2f} bits/weight: allowed >= "
        f"{math.ceil(least * 100) / 100}"))]


def planned(model: nn.Module, q, roles: dict[str, str]) -> list[str]:
    """The linears quantize.target_bpw gives schemes to: those resolve leaves to the plan, never the lm_head."""
    head = model.get_output_embeddings()
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head
            and resolve.linear(q, n, roles.get(n)).movable]


def plan_for(model: nn.Module, q, costs: dict, roles: dict[str, str], backend) -> dict:
    """allocate() for a model: the planned linears' shapes, and the bits of everything else in the file (the
    embedding at its scheme, an lm_head of its own, linears an override pins, the rest fp32)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    shapes, fixed, covered = {}, 0.0, 0
    counted = set()
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or id(w) in counted or not isinstance(m, (nn.Linear, nn.Embedding)):
            continue
        counted.add(id(w))
        n_out, n_in = w.shape
        covered += n_out * n_in
        if name in costs:
            shapes[name] = (n_out, n_in)
            continue
        choice = resolve.embedding(q) if m is embed else resolve.linear(q, name, roles.get(name), head=m is head)
        unplanned = choice.movable and m is not head  # a planned linear without a cost: none is measured, float
        fixed += n_out * n_in * file_bits(*(("none", 0) if unplanned else choice.pair), n_in, backend)
    params = sum(p.numel() for p in model.parameters())
    fixed += 32.0 * max(params - covered, 0)  # norms, biases, convs: float
    return allocate(costs, shapes, fixed, params, q.target_bpw, backend)
