"""The MLX delegate's instructions, each with the meaning of the backend's C++ handler (MLXInterpreter.h, read
for semantics), in Python over `mlx.core` on the CPU. An instruction without a handler raises
UnsupportedInstruction, so a program is never half-run.
"""
from __future__ import annotations

import numpy as np

from pipeline.model.kv.runtime_cache import bound_cache
from pipeline.runtimes.mlx.payload import Graph, UnsupportedInstruction, _mx, mx_dtype, to_mx, to_torch
from pipeline.runtimes.mlx.payload import tid as _tid
from pipeline.runtimes.mlx.math_ops import MathOps
from pipeline.runtimes.mlx.recurrent_ops import RecurrentOps
from pipeline.runtimes.mlx.topk_ops import TopKOps


class State:
    """One execute's slots: tensors (t, by tid) and int/float values (v, by vid)."""

    def __init__(self):
        self.t: dict = {}
        self.v: dict = {}

    def tensor(self, ref):
        idx = _tid(ref)
        if idx not in self.t:
            raise RuntimeError(f"tensor slot {idx} read before it was written")
        return self.t[idx]

    def int(self, ref) -> int:
        if isinstance(ref, dict):
            if "vid" in ref:
                return int(self.v[ref["vid"]])
            return int(ref["literal"])
        return int(ref)

    def float(self, ref) -> float:
        if isinstance(ref, dict):
            if "vid" in ref:
                return float(self.v[ref["vid"]])
            return float(ref["literal"])
        return float(ref)

    def ints(self, refs) -> list[int]:
        return [self.int(r) for r in refs]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _gelu(x, approximate: str):
    mx = _mx()
    if approximate == "tanh":
        c = mx.array(0.7978845608, dtype=x.dtype)
        inner = c * (x + mx.array(0.044715, dtype=x.dtype) * x * x * x)
        return mx.array(0.5, dtype=x.dtype) * x * (mx.array(1.0, dtype=x.dtype) + mx.tanh(inner))
    return mx.array(0.5, dtype=x.dtype) * x * (mx.array(1.0, dtype=x.dtype)
                                               + mx.erf(x * mx.array(0.7071067812, dtype=x.dtype)))


def _slice_bounds(x, axis: int, start: int, stop: int):
    rank = x.ndim
    axis = _axis(axis, rank)
    dim = x.shape[axis]
    start = start + dim if start < 0 else start
    stop = stop + dim if stop < 0 else stop
    start, stop = max(0, min(start, dim)), max(0, min(stop, dim))
    return axis, start, stop


def _index(rank: int, axis: int, sl) -> tuple:
    return tuple(sl if i == axis else slice(None) for i in range(rank))

class Interpreter(TopKOps, RecurrentOps, MathOps):
    """Handlers by op name; each reads its operands from the State and writes its outputs.
    kvcache::update_and_attend reaches the bound runtime-owned cache, as the kernel of our runners does."""

    def run(self, graph: Graph, chain: int, st: State) -> None:
        self.graph = graph  # a ScanNode runs its body chain of the same graph
        for ins in graph.chains[chain]:
            fn = getattr(self, "op_" + ins["op_name"], None)
            if fn is None:
                raise UnsupportedInstruction(ins["op_name"])
            fn(ins, st)

    @classmethod
    def covers(cls, op_name: str) -> bool:
        return hasattr(cls, "op_" + op_name)

    # --- copies, shapes, values ------------------------------------------------------------
    def op_NoopNode(self, n, st):
        pass

    def op_IdCopyNode(self, n, st):
        st.t[_tid(n["out"])] = st.tensor(n["x"])

    def op_ContiguousNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().contiguous(st.tensor(n["x"]))

    def op_SymSizeNode(self, n, st):
        x = st.tensor(n["a"])
        st.v[n["out"]["vid"]] = int(x.shape[_axis(n["dim"], x.ndim)])

    def op_ItemIntNode(self, n, st):
        st.v[n["out"]["vid"]] = int(st.tensor(n["x"]).item())

    def _int_op(self, n, st, f):
        st.v[n["out"]["vid"]] = f(st.int(n["a"]), st.int(n["b"]))

    def op_AddIntNode(self, n, st):
        self._int_op(n, st, lambda a, b: a + b)

    def op_SubtractIntNode(self, n, st):
        self._int_op(n, st, lambda a, b: a - b)

    def op_MultiplyIntNode(self, n, st):
        self._int_op(n, st, lambda a, b: a * b)

    def op_FloorDivideIntNode(self, n, st):
        self._int_op(n, st, lambda a, b: a // b)  # Python floor semantics, as the backend's handler

    def op_ModIntNode(self, n, st):
        self._int_op(n, st, lambda a, b: a % b)

    def op_ReshapeNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().reshape(st.tensor(n["x"]), st.ints(n["shape"]))

    def op_TransposeNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().transpose(st.tensor(n["x"]), list(n["perm"]))

    def op_ExpandDimsNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().expand_dims(st.tensor(n["x"]), n.get("axis", 0))

    def op_SqueezeNode(self, n, st):
        x = st.tensor(n["x"])
        dims = n.get("dims")
        st.t[_tid(n["out"])] = _mx().squeeze(x, dims) if dims else _mx().squeeze(x)

    def op_BroadcastToNode(self, n, st):
        x = st.tensor(n["x"])
        shape = st.ints(n["shape"])
        off = len(shape) - x.ndim
        shape = [x.shape[i - off] if s == -1 and 0 <= i - off < x.ndim else s for i, s in enumerate(shape)]
        st.t[_tid(n["out"])] = _mx().broadcast_to(x, shape)

    def op_TileNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().tile(st.tensor(n["x"]), st.ints(n["reps"]))

    def op_RepeatNode(self, n, st):
        """Each element `repeats` times along `axis` (mx.repeat: aten's repeat_interleave, e.g. GQA's KV heads)."""
        st.t[_tid(n["out"])] = _mx().repeat(st.tensor(n["x"]), st.int(n["repeats"]), axis=n.get("axis", 0))

    def op_ConcatenateNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().concatenate([st.tensor(t) for t in n["tensors"]], axis=n.get("axis", 0))

    def op_StackNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().stack([st.tensor(t) for t in n["tensors"]], axis=n.get("axis", 0))

    def op_SplitNode(self, n, st):
        """Chunks along an axis: one size per output (split_with_sizes), or one size for every chunk, the last
        smaller (split)."""
        x = st.tensor(n["x"])
        axis = _axis(n.get("axis", 0), x.ndim)
        sizes = st.ints(n["sizes"])
        if len(sizes) == 1 and len(n["outs"]) > 1:
            sizes = [min(sizes[0], x.shape[axis] - i * sizes[0]) for i in range(len(n["outs"]))]
        start = 0
        for out, size in zip(n["outs"], sizes):
            st.t[_tid(out)] = x[_index(x.ndim, axis, slice(start, start + size))]
            start += size

    def op_SliceNode(self, n, st):
        x = st.tensor(n["x"])
        step = n.get("step", 1)
        if step < 0:  # a reversal (top-k's descending order): Python's own bounds, as MLX's slice takes them
            axis = _axis(st.int(n["axis"]), x.ndim)
            st.t[_tid(n["out"])] = x[_index(x.ndim, axis, slice(st.int(n["start"]), st.int(n["stop"]), step))]
            return
        axis, start, stop = _slice_bounds(x, st.int(n["axis"]), st.int(n["start"]), st.int(n["stop"]))
        st.t[_tid(n["out"])] = x[_index(x.ndim, axis, slice(start, stop, step))]

    def op_TakeNode(self, n, st):
        mx = _mx()
        x = st.tensor(n["x"])
        axis = _axis(n.get("axis", 0), x.ndim)
        idx = n["index"]
        if "tid" in idx:
            st.t[_tid(n["out"])] = mx.take(x, st.tensor(idx), axis=axis)
        else:
            i = st.int(idx)
            st.t[_tid(n["out"])] = mx.take(x, i + x.shape[axis] if i < 0 else i, axis=axis)

    def op_TakeAlongAxisNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().take_along_axis(st.tensor(n["x"]), st.tensor(n["indices"]),
                                                     axis=n.get("axis", 0))

    def op_AsTypeNode(self, n, st):
        st.t[_tid(n["out"])] = st.tensor(n["x"]).astype(mx_dtype(n["scalar_type"]))

    def op_ARangeNode(self, n, st):
        mx = _mx()
        start, stop, step = st.int(n["start"]), st.int(n["stop"]), st.int(n["step"])
        dtype = mx_dtype(n["scalar_type"]) if n.get("scalar_type") is not None else mx.int32
        st.t[_tid(n["out"])] = mx.arange(start, stop, step, dtype=dtype)

    def op_FullNode(self, n, st):
        mx = _mx()
        # mx.full ignores dtype= for a Python scalar fill: cast after
        st.t[_tid(n["out"])] = mx.full(st.ints(n["shape"]), st.float(n["v"])).astype(mx_dtype(n["scalar_type"]))

    def op_FullLikeNode(self, n, st):
        mx = _mx()
        x = st.tensor(n["x"])
        dtype = mx_dtype(n["scalar_type"]) if n.get("scalar_type") is not None else x.dtype
        st.t[_tid(n["out"])] = mx.full(x.shape, st.float(n["v"])).astype(dtype)

    # --- in-place updates (mutable buffers) --------------------------------------------------
    def op_SliceUpdateNode(self, n, st):
        dst, upd = st.tensor(n["dst"]), st.tensor(n["update"])
        axis, start, stop = _slice_bounds(dst, st.int(n["axis"]), st.int(n["start"]), st.int(n["stop"]))
        step = n.get("step", 1)
        if step < 1:
            raise ValueError(f"SliceUpdateNode: step must be >= 1, got {step}")
        if start != stop:
            dst = _mx().array(dst)  # item assignment mutates in place: update a copy (slots may alias)
            dst[_index(dst.ndim, axis, slice(start, stop, step))] = upd
        st.t[_tid(n["out"])] = dst

    def op_IndexCopyNode(self, n, st):
        mx = _mx()
        dst, upd, idx = st.tensor(n["dst"]), st.tensor(n["update"]), st.tensor(n["indices"])
        if idx.ndim != 1:
            raise ValueError("IndexCopyNode: indices must be 1-d")
        axis = _axis(n.get("axis", 0), dst.ndim)
        dim = dst.shape[axis]
        pos = [int(i) + dim if int(i) < 0 else int(i) for i in np.array(idx).tolist()]
        if any(not 0 <= p < dim for p in pos):
            raise IndexError(f"IndexCopyNode: indices {pos} out of range for size {dim}")
        out = mx.array(dst)
        if pos:
            out[_index(dst.ndim, axis, mx.array(pos))] = upd
        st.t[_tid(n["out"])] = out

    # --- arithmetic ----------------------------------------------------------------------------
    def _binary(self, n, st, f):
        st.t[_tid(n["out"])] = f(st.tensor(n["a"]), st.tensor(n["b"]))

    def op_AddNode(self, n, st):
        self._binary(n, st, lambda a, b: a + b)

    def op_SubtractNode(self, n, st):
        self._binary(n, st, lambda a, b: a - b)

    def op_MultiplyNode(self, n, st):
        self._binary(n, st, lambda a, b: a * b)

    def op_DivideNode(self, n, st):
        self._binary(n, st, lambda a, b: a / b)

    def op_MaximumNode(self, n, st):
        self._binary(n, st, _mx().maximum)

    def op_MinimumNode(self, n, st):
        self._binary(n, st, _mx().minimum)

    def op_PowerNode(self, n, st):
        self._binary(n, st, _mx().power)

    def op_RemainderNode(self, n, st):
        self._binary(n, st, _mx().remainder)

    def op_FloorDivideNode(self, n, st):
        mx = _mx()
        a, b = st.tensor(n["a"]), st.tensor(n["b"])
        q = mx.floor_divide(a, b)
        if not mx.issubdtype(a.dtype, mx.inexact):  # torch floors toward -inf: a remainder takes b's sign
            r = a - q * b
            q = q - ((r != 0) & ((r < 0) != (b < 0))).astype(q.dtype)
        st.t[_tid(n["out"])] = q

    def op_LessNode(self, n, st):
        self._binary(n, st, lambda a, b: a < b)

    def op_LessEqualNode(self, n, st):
        self._binary(n, st, lambda a, b: a <= b)

    def op_GreaterNode(self, n, st):
        self._binary(n, st, lambda a, b: a > b)

    def op_GreaterEqualNode(self, n, st):
        self._binary(n, st, lambda a, b: a >= b)

    def op_EqualNode(self, n, st):
        self._binary(n, st, lambda a, b: a == b)

    def op_NotEqualNode(self, n, st):
        self._binary(n, st, lambda a, b: a != b)

    def op_LogicalAndNode(self, n, st):
        self._binary(n, st, _mx().logical_and)

    def op_LogicalOrNode(self, n, st):
        self._binary(n, st, _mx().logical_or)

    def op_BitwiseAndNode(self, n, st):
        self._binary(n, st, lambda a, b: a & b)

    def op_BitwiseOrNode(self, n, st):
        self._binary(n, st, lambda a, b: a | b)

    def op_LogicalNotNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().logical_not(st.tensor(n["x"]))

    def op_WhereNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().where(st.tensor(n["condition"]), st.tensor(n["x"]), st.tensor(n["y"]))

    def _unary(self, n, st, f):
        st.t[_tid(n["out"])] = f(st.tensor(n["x"]))

    def op_NegNode(self, n, st):
        self._unary(n, st, lambda x: -x)

    def op_SinNode(self, n, st):
        self._unary(n, st, _mx().sin)

    def op_CosNode(self, n, st):
        self._unary(n, st, _mx().cos)

    def op_ExpNode(self, n, st):
        self._unary(n, st, _mx().exp)

    def op_LogNode(self, n, st):
        self._unary(n, st, _mx().log)

    def op_RsqrtNode(self, n, st):
        self._unary(n, st, _mx().rsqrt)

    def op_SqrtNode(self, n, st):
        self._unary(n, st, _mx().sqrt)

    def op_TanhNode(self, n, st):
        self._unary(n, st, _mx().tanh)

    def op_SigmoidNode(self, n, st):
        self._unary(n, st, _mx().sigmoid)

    def op_Log1pNode(self, n, st):
        self._unary(n, st, _mx().log1p)

    def op_LogAddExpNode(self, n, st):
        self._binary(n, st, _mx().logaddexp)

    def op_AbsNode(self, n, st):
        self._unary(n, st, _mx().abs)

    def op_SquareNode(self, n, st):
        self._unary(n, st, _mx().square)

    def op_ReciprocalNode(self, n, st):
        self._unary(n, st, _mx().reciprocal)

    def op_SiluNode(self, n, st):
        self._unary(n, st, lambda x: x * _mx().sigmoid(x))

    def op_GeluNode(self, n, st):
        st.t[_tid(n["out"])] = _gelu(st.tensor(n["x"]), n.get("approximate", "none"))

    def op_SoftmaxNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().softmax(st.tensor(n["x"]), axis=n.get("axis", -1), precise=n.get("precise", False))

    def _reduce(self, n, st, f):
        x = st.tensor(n["x"])
        axes = list(n.get("axes") or range(x.ndim))
        st.t[_tid(n["out"])] = f(x, axis=axes, keepdims=bool(n.get("keepdims", False)))

    def op_SumNode(self, n, st):
        self._reduce(n, st, _mx().sum)

    def op_MeanNode(self, n, st):
        self._reduce(n, st, _mx().mean)

    def op_ArgmaxNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().argmax(st.tensor(n["x"]), axis=n.get("axis", -1),
                                            keepdims=bool(n.get("keepdims", False)))

    # --- linear algebra, normalisation, attention ----------------------------------------------
    def op_AddmmNode(self, n, st):
        mx = _mx()
        a, b = st.tensor(n["mat1"]), st.tensor(n["mat2"])
        if n.get("bias") is not None:
            st.t[_tid(n["out"])] = mx.addmm(st.tensor(n["bias"]), a, b, alpha=n.get("alpha", 1.0),
                                            beta=n.get("beta", 1.0))
        else:
            st.t[_tid(n["out"])] = mx.matmul(a, b)

    def op_QuantizedMatmulNode(self, n, st):
        mx = _mx()
        x, scales = st.tensor(n["x"]), st.tensor(n["scales"])
        biases = st.tensor(n["biases"]) if n.get("biases") is not None else None
        # MLX's CPU kernel accumulates fp16/bf16 inputs in the half type (measured: 10 % off an fp32 sum at K=512);
        # its GPU kernels, what the program runs on, accumulate in fp32: so do we
        out_dtype = x.dtype
        if out_dtype in (mx.float16, mx.bfloat16) and n.get("mode", "affine") == "affine":
            x, scales = x.astype(mx.float32), scales.astype(mx.float32)
            biases = biases.astype(mx.float32) if biases is not None else None
        st.t[_tid(n["out"])] = mx.quantized_matmul(
            x, st.tensor(n["w"]), scales, biases,
            transpose=bool(n.get("transpose", True)), group_size=n["group_size"], bits=n["bits"],
            mode=n.get("mode", "affine")).astype(out_dtype)

    def op_DequantizeNode(self, n, st):
        mx = _mx()
        kw = {"group_size": n["group_size"], "bits": n["bits"], "mode": n.get("mode", "affine")}
        if n.get("global_scale") is not None:
            kw["global_scale"] = st.tensor(n["global_scale"])
        if n.get("dtype") is not None:
            kw["dtype"] = mx_dtype(n["dtype"])
        biases = st.tensor(n["biases"]) if n.get("biases") is not None else None
        st.t[_tid(n["out"])] = mx.dequantize(st.tensor(n["w"]), st.tensor(n["scales"]), biases, **kw)

    def op_RMSNormNode(self, n, st):
        w = st.tensor(n["weight"]) if n.get("weight") is not None else None
        st.t[_tid(n["out"])] = _mx().fast.rms_norm(st.tensor(n["x"]), w, n["eps"])

    def op_LayerNormNode(self, n, st):
        w = st.tensor(n["weight"]) if n.get("weight") is not None else None
        b = st.tensor(n["bias"]) if n.get("bias") is not None else None
        st.t[_tid(n["out"])] = _mx().fast.layer_norm(st.tensor(n["x"]), w, b, n["eps"])

    def op_RopeNode(self, n, st):
        mx = _mx()
        off = n["offset"]
        offset = int(st.v[off["vid"]]) if "vid" in off else st.tensor(off)
        freqs = st.tensor(n["freqs"]) if n.get("freqs") is not None else None
        st.t[_tid(n["out"])] = mx.fast.rope(st.tensor(n["x"]), n["dims"], traditional=bool(n.get("traditional")),
                                            base=None if freqs is not None else n.get("base"),
                                            scale=n.get("scale", 1.0), offset=offset, freqs=freqs)

    def op_SdpaNode(self, n, st):
        mx = _mx()
        q = st.tensor(n["q"])
        mask = None
        if n.get("mask") is not None:
            mask = st.tensor(n["mask"])
            if mask.dtype != mx.bool_ and mask.dtype != q.dtype:
                mask = mask.astype(q.dtype)
        if n.get("causal"):
            mask = "causal" if mask is None else mask  # the backend passes both; a mask already encodes it
        st.t[_tid(n["out"])] = mx.fast.scaled_dot_product_attention(
            q, st.tensor(n["k"]), st.tensor(n["v"]), scale=n["scale"], mask=mask)

    def op_UpdateAndAttendNode(self, n, st):
        """kvcache::update_and_attend over the runtime-owned cache: write this step's K/V, read the
        layer's history, attend with fp32 softmax (mlx's SDPA) under the window/causal mask."""
        mx = _mx()
        cache = bound_cache()
        for key in ("layer_id", "scale"):
            if n.get(key) is None:
                raise ValueError(f"update_and_attend: {key} is not set")
        q, k, v = st.tensor(n["q"]), st.tensor(n["k"]), st.tensor(n["v"])
        pos_arr = np.array(st.tensor(n["position"])).reshape(-1)
        pos, T = int(pos_arr[0]), q.shape[2]
        layer = int(n["layer_id"])
        plan = cache.plan(layer, pos, T)
        cache.write(plan, to_torch(k[0]), to_torch(v[0]))
        K, V = cache.gather(plan)                                      # [Hkv,S,D], oldest first
        K, V = to_mx(K)[None].astype(q.dtype), to_mx(V)[None].astype(q.dtype)
        window = cache.specs[layer].window
        qpos = mx.arange(pos, pos + T)[:, None]
        kpos = mx.arange(plan.base, plan.end)[None, :]
        visible = kpos <= qpos
        if window > 0:
            visible = visible & (kpos > qpos - window)
        out = mx.fast.scaled_dot_product_attention(q, K, V, scale=float(n["scale"]), mask=visible)
        if n.get("out_dtype") is not None:
            out = out.astype(mx_dtype(n["out_dtype"]))
        st.t[_tid(n["out"])] = out
