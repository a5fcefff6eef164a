"""The routers' index ops the MLX delegate (executorch 1.5.1) has nodes for but no handler, so that a router leaves
nothing outside the delegate (an MLX program runs delegate calls only). Registered once, at setup.

- aten.gather as TakeAlongAxisNode: a router that picks its top-k after a per-expert bias and then gathers the
  unbiased scores (ERNIE 4.5 MoE, LFM2-MoE). gather's out[i][j] = x[i][index[i][j]] (along dim) is take_along_axis
  where index matches x in every other dim, which the support check asks of the node's shapes.
- aten.scatter.value (a value written at the indexed places): Nemotron-H's router marks its chosen expert groups so.
  As where(scatter_add(0, index, 1) > 0, value, x): ScatterAddNode counts the writes per place, and a place written
  once or more holds the value, as the overwrite leaves it."""
from __future__ import annotations

import torch

TARGET = torch.ops.aten.gather.default
SCATTER = torch.ops.aten.scatter.value


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


def _scatter_supported(P, n) -> bool:
    return len(n.args) == 4 and not n.kwargs and isinstance(n.args[3], (int, float))


def _scatter(P, n):
    from executorch.backends.mlx.builder.op_helpers import torch_dtype_to_scalar_type
    from executorch.backends.mlx.serialization.mlx_graph_schema import (FloatOrVid, FullLikeNode, GreaterNode,
                                                                        ScatterAddNode, WhereNode)
    x, dim, index, value = P.args(n)[:4]
    axis = dim % n.args[0].meta["val"].dim()
    slots = {name: P.make_tmp_slot()[1] for name in ("zeros", "ones", "count", "marked", "values")}
    tid = {name: P.slot_to_tid(s) for name, s in slots.items()}
    f32 = torch_dtype_to_scalar_type(torch.float32)
    P.emit(FullLikeNode(x=P.slot_to_tid(x), out=tid["zeros"], v=FloatOrVid.from_literal(0.0), scalar_type=f32))
    P.emit(FullLikeNode(x=P.slot_to_tid(index), out=tid["ones"], v=FloatOrVid.from_literal(1.0), scalar_type=f32))
    P.emit(ScatterAddNode(x=tid["zeros"], indices=P.slot_to_tid(index), updates=tid["ones"], out=tid["count"],
                          axis=axis))
    P.emit(FullLikeNode(x=P.slot_to_tid(x), out=tid["values"], v=FloatOrVid.from_literal(float(value))))
    P.emit(GreaterNode(a=tid["count"], b=tid["zeros"], out=tid["marked"]))
    out = P.make_or_get_slot(n)
    P.emit(WhereNode(condition=tid["marked"], x=tid["values"], y=P.slot_to_tid(x), out=P.slot_to_tid(out)))
    return out


def register() -> None:
    from executorch.backends.mlx.builder.op_registry import REGISTRY
    if TARGET in REGISTRY.registered_ops():
        return
    REGISTRY.register(target=[TARGET])(_gather)
    REGISTRY.register_support_check(target=[TARGET])(_supported)
    REGISTRY.register(target=[SCATTER])(_scatter)
    REGISTRY.register_support_check(target=[SCATTER])(_scatter_supported)
