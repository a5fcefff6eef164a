"""aten.gather as the MLX delegate's TakeAlongAxisNode. The delegate (executorch 1.5.1) has the node but no handler
for the op, so a router that picks its top-k after a per-expert bias and then gathers the unbiased scores (ERNIE 4.5
MoE, LFM2-MoE) would leave a gather outside the delegate, and an MLX program runs delegate calls only. Registered
once, at setup; gather's out[i][j] = x[i][index[i][j]] (along dim) is take_along_axis where index matches x in
every other dim, which the support check asks of the node's shapes."""
from __future__ import annotations

import torch

TARGET = torch.ops.aten.gather.default


def _shapes(n):
    x, dim, index = n.args[0].meta["val"], n.args[1], n.args[2].meta["val"]
    return list(x.shape), dim % x.dim(), list(index.shape)


def _supported(P, n) -> bool:
    if len(n.args) != 3 or n.kwargs.get("sparse_grad"):
        return False
    x, dim, index = _shapes(n)
    return len(x) == len(index) and all(str(a) == str(b) for d, (a, b) in enumerate(zip(x, index)) if d != dim)


def _gather(P, n):
    from executorch.backends.mlx.serialization.mlx_graph_schema import TakeAlongAxisNode
    if not _supported(P, n):
        raise ValueError("aten.gather: the index must match the input in every dim but the gathered one")
    x, _, index = P.args(n)[:3]
    out = P.make_or_get_slot(n)
    P.emit(TakeAlongAxisNode(x=P.slot_to_tid(x), indices=P.slot_to_tid(index), out=P.slot_to_tid(out),
                             axis=_shapes(n)[1]))
    return out


def register() -> None:
    from executorch.backends.mlx.builder.op_registry import REGISTRY
    if TARGET in REGISTRY.registered_ops():
        return
    REGISTRY.register(target=[TARGET])(_gather)
    REGISTRY.register_support_check(target=[TARGET])(_supported)
