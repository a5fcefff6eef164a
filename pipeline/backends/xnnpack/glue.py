"""The glue between a decoder layer's matmuls in forms XNNPACK takes, so a layer lowers as one delegate call.

Why: with the token dimension T dynamic, XNNPACK's partitioner refuses four kinds of glue that HF's Llama / Gemma
code emits, and every refused node splits the delegate (SmolLM2: 183 delegate calls and 945 portable ops per
token; lowering time grows with the count too, each partition being preprocessed on its own):
- a reshape naming T symbolically (`view(1, T, H, D)`): XNNPACK reshapes take one inferred dimension, so the
  symbolic one becomes -1 (the others are static in these graphs);
- `unsqueeze` anywhere but the last dimension (RoPE's cos/sin): the same reshape;
- RMSNorm's `mean(x^2, -1, keepdim)` (XNNPACK's mean is a 4-d global pooling over the two inner dimensions): a
  matmul with a column of ones, then a division by the width (fp32 only: HF's norms compute in fp32 anyway);
- RoPE's `rotate_half`, `cat(-x[..., D/2:], x[..., :D/2])`: slices of a dynamic shape are refused; it is a
  matmul with a constant signed permutation, exact in any float type (one non-zero product per output);
- the tanh GELU of Gemma's MLPs, which XNNPACK's erf GELU cannot run (weight_only.ExactGeluConfig keeps it out):
  its formula in the multiplies, adds and tanh XNNPACK has (fp32 only, like the mean).

Each rewrite is matched exactly and leaves anything else alone; the graph computes the same function (the mean's
sum order aside: a last-bit difference).
"""
from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import PassResult

ops = exir_ops.edge.aten


def _shape(n) -> list | None:
    val = n.meta.get("val") if isinstance(n, Node) else None
    return list(val.shape) if isinstance(val, torch.Tensor) else None


def _one_inferred(shape: list) -> list | None:
    """The shape with its single symbolic dimension as -1; None if there are several (or an explicit -1 too)."""
    symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    if len(symbolic) != 1:
        return None
    return [-1 if i == symbolic[0] else d for i, d in enumerate(shape)]


def _constant(gm: GraphModule, like: Node, name: str, value: torch.Tensor) -> Node:
    """A get_attr node holding `value` (lifted to a program constant after the transform passes)."""
    attr = name
    i = 0
    while hasattr(gm, attr):
        i += 1
        attr = f"{name}_{i}"
    gm.register_buffer(attr, value, persistent=False)
    with gm.graph.inserting_before(like):
        node = gm.graph.get_attr(attr)
    node.meta["val"] = value  # real tensor metadata: shape and dtype are all the passes read
    return node


def _replace(gm: GraphModule, old: Node, target, args: tuple) -> Node:
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(target, args)
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)
    return new


def _reshapes(gm: GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (ops.view_copy.default, ops.unsqueeze_copy.default):
            continue
        shape = _shape(n)
        if shape is None:
            continue
        if n.target == ops.view_copy.default and all(isinstance(d, int) for d in n.args[1]):
            continue  # already static or one inferred
        if n.target == ops.unsqueeze_copy.default and n.args[1] in (-1, len(shape) - 1):
            continue  # the trailing unsqueeze XNNPACK takes
        new_shape = _one_inferred(shape)
        if new_shape is None:
            continue
        _replace(gm, n, ops.view_copy.default, (n.args[0], new_shape))
        count += 1
    return count


def _means(gm: GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != ops.mean.dim or n.kwargs.get("dtype") is not None:
            continue
        x = n.args[0]
        shape = _shape(x)
        dims = n.args[1]
        keep = len(n.args) > 2 and bool(n.args[2])
        if shape is None or len(shape) < 2 or not keep or dims is None or list(dims) not in ([-1], [len(shape) - 1]) \
                or not isinstance(shape[-1], int):
            continue
        width = shape[-1]
        dtype = x.meta["val"].dtype
        if dtype != torch.float32:  # a half GEMM may accumulate in half: a sum of squares would overflow
            continue
        ones = _constant(gm, n, "glue_ones", torch.ones(1, width, dtype=dtype))
        with gm.graph.inserting_before(n):
            total = gm.graph.call_function(ops.linear.default, (x, ones))
            total.meta["val"] = n.meta["val"]
        _replace(gm, n, ops.div.Tensor, (total, _scalar(gm, n, width, dtype)))
        count += 1
    return count


def _scalar(gm: GraphModule, like: Node, value, dtype) -> Node:
    return _constant(gm, like, "glue_scalar", torch.tensor([value], dtype=dtype))


def _slice_of(n, x: Node, start: int, end: int, dim_size: int) -> bool:
    if not (isinstance(n, Node) and n.op == "call_function" and n.target == ops.slice_copy.Tensor):
        return False
    args = list(n.args) + [None] * (5 - len(n.args))
    dim, lo, hi, step = args[1], args[2], args[3], args[4] if args[4] is not None else 1
    rank = len(_shape(x) or [])
    if n.args[0] is not x or dim not in (-1, rank - 1) or step != 1:
        return False
    hi = dim_size if hi is None or (isinstance(hi, int) and hi >= dim_size) else hi
    return (lo or 0) == start and hi == end


def _rotate_halves(gm: GraphModule) -> int:
    """cat([neg(x[..., h:]), x[..., :h]], -1) -> linear(x, R) with R the signed half swap."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != ops.cat.default:
            continue
        parts = n.args[0]
        dim = n.args[1] if len(n.args) > 1 else 0
        if len(parts) != 2 or not (isinstance(parts[0], Node) and parts[0].target == ops.neg.default):
            continue
        second = parts[0].args[0]
        first = parts[1]
        if not isinstance(second, Node) or not isinstance(first, Node):
            continue
        x = second.args[0] if second.target == ops.slice_copy.Tensor else None
        shape = _shape(x)
        if shape is None or dim not in (-1, len(shape) - 1) or not isinstance(shape[-1], int) or shape[-1] % 2:
            continue
        d = shape[-1]
        h = d // 2
        if not (_slice_of(second, x, h, d, d) and _slice_of(first, x, 0, h, d)):
            continue
        dtype = x.meta["val"].dtype
        # out[:h] = -x[h:], out[h:] = x[:h]; linear computes x @ W^T, so W[j, k] = coefficient of x[k] in out[j]
        w = torch.zeros(d, d, dtype=dtype)
        w[torch.arange(h), torch.arange(h) + h] = -1
        w[torch.arange(h) + h, torch.arange(h)] = 1
        weight = _constant(gm, n, "glue_rotate_half", w)
        _replace(gm, n, ops.linear.default, (x, weight))
        count += 1
    return count


def _tanh_gelus(gm: GraphModule) -> int:
    """gelu(x, approximate='tanh') = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != ops.gelu.default or n.kwargs.get("approximate") != "tanh":
            continue
        x = n.args[0]
        dtype = x.meta["val"].dtype
        if dtype != torch.float32:  # in half, each op of the formula would round where the fused op does not
            continue
        c = {k: _scalar(gm, n, val, dtype) for k, val in
             (("half", 0.5), ("one", 1.0), ("kappa", 0.044715), ("beta", math.sqrt(2 / math.pi)))}
        g = gm.graph
        with g.inserting_before(n):
            def op(target, *args):
                node = g.call_function(target, args)
                node.meta["val"] = n.meta["val"]
                return node
            cube = op(ops.mul.Tensor, op(ops.mul.Tensor, x, x), x)
            inner = op(ops.mul.Tensor, op(ops.add.Tensor, x, op(ops.mul.Tensor, cube, c["kappa"])), c["beta"])
            gate = op(ops.add.Tensor, op(ops.tanh.default, inner), c["one"])
            half_x = op(ops.mul.Tensor, x, c["half"])
        _replace(gm, n, ops.mul.Tensor, (half_x, gate))
        count += 1
    return count


def delegable_glue(gm: GraphModule) -> PassResult:
    """The edge transform pass (before partitioning): the rewrites above, counted in gm.meta['glue']."""
    counts = {"reshapes": _reshapes(gm), "means": _means(gm), "rotate_halves": _rotate_halves(gm),
              "tanh_gelus": _tanh_gelus(gm)}
    changed = any(counts.values())
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    gm.meta["glue"] = counts
    return PassResult(gm, changed)
