"""The same routing in wrap's self-check: HF's forward records each mixture-of-experts router's choice, and the
wrapped module's check runs on those choices.

Where a token's k-th and (k+1)-th experts score within rounding of each other, the router picks either one by the
order its sums ran in. The wrapped module sums in other orders than HF's uncached forward (chunks, caches, the
rewritten experts), so a check of their logits would fail or pass by chance: a different expert moves a logit by
the order of the logits themselves. The router is HF's own module, untouched; what the check is for (caches,
attention, the experts' rewrite) shows in the logits whichever expert is chosen. So the check replays HF's top-k
index and weights, row for row in the order the rows ran, and counts the rows whose own choice differed.

Every router of the registry returns (logits, top-k weights, top-k index) over rows [N, hidden].
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from pipeline.model import archs


def routers(model: nn.Module) -> list[nn.Module]:
    """The router module of each mixture-of-experts layer, in layer order."""
    a = archs.of_model(model)
    if a.experts is None:
        return []
    return [a.mlp_module(layer).get_submodule(a.experts.router) for layer in a.decoder_layers(model)
            if a.has_experts(layer)]


@contextmanager
def recorded(model: nn.Module) -> Iterator[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Within: each router's (top-k weights, top-k index) of every call, per router, appended in call order."""
    record: list[list] = [[] for _ in routers(model)]

    def hook(i):
        def keep(module, args, out):
            record[i].append((out[1].detach().clone(), out[2].detach().clone()))
        return keep

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers(model))]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replayed(model: nn.Module, record: list) -> Iterator[dict]:
    """Within: each router's calls take the recorded rows in order (its own logits kept); the dict counts the rows
    replayed and those whose own top-k set differed."""
    rows = [(torch.cat([w for w, _ in calls]), torch.cat([ix for _, ix in calls])) if calls else None
            for calls in record]
    cursor = [0] * len(rows)
    counts = {"routed_rows": 0, "rerouted_rows": 0}

    def hook(i):
        def replay(module, args, out):
            n = out[2].shape[0]
            weights, index = rows[i]
            if cursor[i] + n > index.shape[0]:
                raise RuntimeError(f"routing replay: router {i} ran {cursor[i] + n} rows, "
                                   f"HF's forward {index.shape[0]}")
            w, ix = weights[cursor[i]:cursor[i] + n], index[cursor[i]:cursor[i] + n]
            cursor[i] += n
            counts["routed_rows"] += n
            counts["rerouted_rows"] += int((out[2].sort(-1).values != ix.sort(-1).values).any(-1).sum())
            return out[0], w.to(out[1].dtype), ix
        return replay

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers(model)) if rows[i] is not None]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
