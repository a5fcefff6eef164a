"""Run an MLX-delegated .pte without a Mac: read the delegate's payload and execute it with `mlx` on the CPU.

    python -m pipeline.mlx_interpreter model.pte          # list the instructions and whether each is covered

ExecuTorch's MLX backend (C++, Apple only) interprets a FlatBuffer program (schema.fbs in the
wheel): tensor slots (constants, inputs, outputs, mutable buffers, temporaries), int/float value
slots, and chains of instructions. This module reads the same payload and gives every instruction
the meaning of the backend's handler, in Python over `mlx.core`. Constants come from the .pte's named
data, mutable buffers (an in-graph KV cache) start at zero and persist across calls, and
kvcache::update_and_attend reaches a runtime-owned cache (pipeline.offgraph.OffgraphCache, the same
policy our runners use). An instruction without a handler raises UnsupportedInstruction, so a program
is never half-run.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch


class UnsupportedInstruction(RuntimeError):
    def __init__(self, op: str, why: str = ""):
        super().__init__(f"unsupported: {op}" + (f" ({why})" if why else ""))
        self.op = op


def _mx():
    import mlx.core as mx
    return mx


# ExecuTorch ScalarType codes -> numpy / mlx / torch
_NP = {0: np.uint8, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.int64, 5: np.float16, 6: np.float32,
       11: np.bool_, 15: np.uint16, 28: np.uint32}
_TORCH = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
          6: torch.float32, 11: torch.bool, 15: torch.bfloat16}


def mx_dtype(code: int):
    mx = _mx()
    table = {0: mx.uint8, 1: mx.int8, 2: mx.int16, 3: mx.int32, 4: mx.int64, 5: mx.float16, 6: mx.float32,
             11: mx.bool_, 15: mx.bfloat16, 28: mx.uint32}
    if code not in table:
        raise UnsupportedInstruction(f"ScalarType {code}")
    return table[code]


def to_mx(t: torch.Tensor):
    mx = _mx()
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def to_torch(a) -> torch.Tensor:
    mx = _mx()
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


# --------------------------------------------------------------------------------------------------
# the payload
# --------------------------------------------------------------------------------------------------
@dataclass
class Meta:
    shape: list            # ints; None for a dynamic dim
    scalar_type: int


@dataclass
class Graph:
    """One MLX delegate payload, decoded."""
    num_constants: int
    num_values: int
    chains: list           # [[instruction dict]]
    main_chain: int
    init_chain: int
    inputs: list           # [(slot idx, slot type)]
    outputs: list
    mutable: list
    names: dict            # tid -> name (constants and mutable buffers)
    meta: dict             # tid -> Meta

    def ops(self) -> list[str]:
        return [ins["op_name"] for chain in self.chains for ins in chain]


def decode_payload(raw: bytes) -> Graph:
    from pipeline.backends.mlx_schema import ensure
    ensure()
    from executorch.backends.mlx.pte_inspector import (MLX_HEADER_LENGTH, MLXHeader, _get_fb_graph,
                                                       _parse_instructions)
    header = MLXHeader.from_bytes(raw)
    if not header.is_valid():
        raise ValueError(f"not an MLX delegate payload (magic {header.magic!r})")
    g = _get_fb_graph(raw[MLX_HEADER_LENGTH:header.data_segment_offset])
    chains = []
    for chain in _parse_instructions(g):
        for ins in chain["instructions"]:
            if "error" in ins or "parse_error" in ins:
                raise ValueError(f"instruction {ins.get('instr_idx')} cannot be decoded: {ins}")
        chains.append(chain["instructions"])
    slots = lambda n, get: [(get(i).Idx(), get(i).SlotType()) for i in range(n)]  # noqa: E731
    meta = {}
    for i in range(g.TensorMetaLength()):
        tm = g.TensorMeta(i)
        if tm is None:
            continue
        dims = [tm.Shape(j).Value() for j in range(tm.ShapeLength())]
        meta[i] = Meta([d if d >= 0 else None for d in dims], tm.ScalarType())
    names = {}
    for i in range(g.NamedSlotsLength()):
        ns = g.NamedSlots(i)
        if ns.Slot().SlotType() == 0:
            names[ns.Slot().Idx()] = ns.Name().decode()
    return Graph(num_constants=g.NumConstantTensors(), num_values=g.NumValues(), chains=chains,
                 main_chain=g.MainChainIdx(), init_chain=g.InitChainIdx(),
                 inputs=slots(g.InputMapLength(), g.InputMap), outputs=slots(g.OutputMapLength(), g.OutputMap),
                 mutable=slots(g.MutableBufferMapLength(), g.MutableBufferMap), names=names, meta=meta)


# --------------------------------------------------------------------------------------------------
# execution
# --------------------------------------------------------------------------------------------------
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


def _tid(ref) -> int:
    if isinstance(ref, str):  # tid lists decode as "tid N"
        return int(ref.split()[1])
    return int(ref["tid"])


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


class Interpreter:
    """Handlers by op name; each reads its operands from the State and writes its outputs."""

    def __init__(self, cache=None):
        self.cache = cache  # OffgraphCache for kvcache::update_and_attend programs

    def run(self, graph: Graph, chain: int, st: State) -> None:
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

    def op_ConcatenateNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().concatenate([st.tensor(t) for t in n["tensors"]], axis=n.get("axis", 0))

    def op_SliceNode(self, n, st):
        x = st.tensor(n["x"])
        axis, start, stop = _slice_bounds(x, st.int(n["axis"]), st.int(n["start"]), st.int(n["stop"]))
        st.t[_tid(n["out"])] = x[_index(x.ndim, axis, slice(start, stop, n.get("step", 1)))]

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
        biases = st.tensor(n["biases"]) if n.get("biases") is not None else None
        st.t[_tid(n["out"])] = mx.quantized_matmul(
            st.tensor(n["x"]), st.tensor(n["w"]), st.tensor(n["scales"]), biases,
            transpose=bool(n.get("transpose", True)), group_size=n["group_size"], bits=n["bits"],
            mode=n.get("mode", "affine"))

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
        if self.cache is None:
            raise RuntimeError("update_and_attend: no cache installed (program needs a runtime-owned cache)")
        for key in ("layer_id", "scale"):
            if n.get(key) is None:
                raise ValueError(f"update_and_attend: {key} is not set")
        q, k, v = st.tensor(n["q"]), st.tensor(n["k"]), st.tensor(n["v"])
        pos_arr = np.array(st.tensor(n["position"])).reshape(-1)
        pos, T = int(pos_arr[0]), q.shape[2]
        layer = int(n["layer_id"])
        cache = self.cache
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


# --------------------------------------------------------------------------------------------------
# the program
# --------------------------------------------------------------------------------------------------
class Delegate:
    """One MLX payload with its constants and its persistent mutable buffers."""

    def __init__(self, graph: Graph, named_data: dict):
        mx = _mx()
        self.graph = graph
        self.constants = {}
        for tid in range(graph.num_constants):
            name, meta = graph.names.get(tid), graph.meta.get(tid)
            if name is None or meta is None or name not in named_data:
                raise ValueError(f"constant tensor {tid} ({name}) has no data in the .pte")
            arr = np.frombuffer(named_data[name], dtype=_NP[meta.scalar_type]).reshape(meta.shape)
            a = mx.array(arr)
            self.constants[tid] = a.view(mx.bfloat16) if meta.scalar_type == 15 else a
        self.reset()

    def reset(self) -> None:
        mx = _mx()
        self.buffers = {idx: mx.zeros(self.graph.meta[idx].shape, dtype=mx_dtype(self.graph.meta[idx].scalar_type))
                        for idx, _ in self.graph.mutable}

    def execute(self, interp: Interpreter, args: Sequence) -> list:
        mx = _mx()
        g = self.graph
        st = State()
        st.t.update(self.constants)
        st.t.update(self.buffers)
        if len(args) != len(g.inputs):
            raise ValueError(f"the delegate takes {len(g.inputs)} inputs, got {len(args)}")
        for (idx, kind), a in zip(g.inputs, args):
            if kind == 0:
                t = to_mx(a)
                want = g.meta[idx].scalar_type
                if t.dtype != mx_dtype(want):
                    raise TypeError(f"input slot {idx}: dtype {t.dtype}, the program expects {mx_dtype(want)}")
                st.t[idx] = t
            else:
                st.v[idx] = int(a)
        if g.init_chain >= 0:
            interp.run(g, g.init_chain, st)
        interp.run(g, g.main_chain, st)
        for idx, _ in g.mutable:
            self.buffers[idx] = st.t[idx]
        outs = []
        for idx, kind in g.outputs:
            if kind == 0:
                a = st.t[idx]
                want = g.meta[idx].scalar_type if idx in g.meta else None
                if want is not None and a.dtype != mx_dtype(want):
                    a = a.astype(mx_dtype(want))
                outs.append(a)
            else:
                outs.append(int(st.v[idx]))
        mx.eval([o for o in outs if not isinstance(o, int)] + list(self.buffers.values()))
        return outs


class MLXProgram:
    """A .pte whose forward is MLX delegate calls; constant methods are read from the program itself."""

    def __init__(self, path: Path):
        from executorch.exir._serialize._program import deserialize_pte_binary
        from executorch.exir.schema import DelegateCall, KernelCall
        pte = deserialize_pte_binary(Path(path).read_bytes())
        program = pte.program
        named = {}
        if pte.named_data is not None:
            for key, entry in pte.named_data.pte_data.items():
                named[key] = pte.named_data.buffers[entry.buffer_index]
        self.plans = {p.name: p for p in program.execution_plan}
        if "forward" not in self.plans:
            raise ValueError(f"{path}: no forward method")
        self.plan = self.plans["forward"]
        self.program = program
        self.calls = []
        for chain in self.plan.chains:
            for ins in chain.instructions:
                a = ins.instr_args
                if isinstance(a, KernelCall):
                    op = self.plan.operators[a.op_index]
                    raise UnsupportedInstruction(f"kernel {op.name}{'.' + op.overload if op.overload else ''}",
                                                 "outside the MLX delegate")
                if not isinstance(a, DelegateCall):
                    raise UnsupportedInstruction(type(a).__name__, "outer-program instruction")
                d = self.plan.delegates[a.delegate_index]
                if d.id != "MLXBackend":
                    raise UnsupportedInstruction(f"delegate {d.id}")
                raw = self._payload(d)
                self.calls.append((Delegate(decode_payload(raw), named), list(a.args)))

    def _payload(self, d) -> bytes:
        from executorch.exir.schema import DataLocation
        ref = d.processed
        if ref.location == DataLocation.INLINE:
            return bytes(self.program.backend_delegate_data[ref.index].data)
        return bytes(self.program.segments[ref.index].data)  # restored by deserialize_pte_binary

    def ops(self) -> list[str]:
        return [op for delegate, _ in self.calls for op in delegate.graph.ops()]

    def constant(self, name: str):
        plan = self.plans[name]
        vals = []
        for i in plan.outputs:
            val = plan.values[i].val
            if hasattr(val, "int_val"):
                vals.append(val.int_val)
            elif hasattr(val, "items"):  # IntList / DoubleList
                vals.append(list(val.items))
            elif hasattr(val, "double_val"):
                vals.append(val.double_val)
            elif hasattr(val, "bool_val"):
                vals.append(val.bool_val)
            elif hasattr(val, "string_val"):
                vals.append(val.string_val)
            else:
                vals.append(self._constant_tensor(plan, val))
        return vals[0] if len(vals) == 1 else vals

    def _constant_tensor(self, plan, t):
        buf = self.program.constant_buffer[t.data_buffer_idx].storage if t.data_buffer_idx < len(
            self.program.constant_buffer) else b""
        dtype = _TORCH[int(t.scalar_type)]
        if not buf:  # the constant segment
            seg = self.program.constant_segment
            raise UnsupportedInstruction("constant method tensor in a segment", str(seg))
        numel = int(np.prod(list(t.sizes))) if len(t.sizes) else 1
        data = bytearray(buf[:numel * torch.empty((), dtype=dtype).element_size()])  # storage is padded
        return torch.frombuffer(data, dtype=dtype).reshape(list(t.sizes)).clone()

    def execute(self, interp: Interpreter, inputs: Sequence) -> list:
        values: dict = {i: x for i, x in zip(self.plan.inputs, inputs)}
        for delegate, args in self.calls:
            n_in = len(delegate.graph.inputs)
            outs = delegate.execute(interp, [values[i] for i in args[:n_in]])
            for i, o in zip(args[n_in:], outs):
                values[i] = o
        return [to_torch(values[i]) if not isinstance(values[i], (int, torch.Tensor)) else values[i]
                for i in self.plan.outputs]

    def reset(self) -> None:
        for delegate, _ in self.calls:
            delegate.reset()


class MLXPteModule:
    """An MLX .pte run by the interpreter, callable like the eager wrapper: (tokens [1,T], positions [T])
    -> logits. Off-graph programs get a runtime cache from their constant methods (as our runners)."""

    def __init__(self, path, capacity: Optional[int] = None, initial_capacity: int = 512,
                 kv_dtype: Optional[torch.dtype] = None, windows: Optional[Sequence[int]] = None):
        self.program = MLXProgram(path)
        self.cache = None
        names = set(self.program.plans)
        if "get_n_caches" in names:  # an off-graph program: the runtime-owned cache our runners build
            from pipeline.offgraph import OffgraphCache, runtime_cache_plan
            specs, ctx, max_write, dtype = runtime_cache_plan(self.program.constant, names, windows, kv_dtype)
            self.cache = OffgraphCache(specs, capacity or ctx, max_write, initial_capacity, dtype)
        self.interp = Interpreter(self.cache)

    def constant(self, name: str):
        return self.program.constant(name)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.cache is not None:
            pos, T = int(positions[0]), int(positions.numel())
            if pos < self.cache.length:
                self.cache.rewind(pos)
            out = self.program.execute(self.interp, [tokens, positions])[0]
            self.cache.commit(pos, T)
            return out
        return self.program.execute(self.interp, [tokens, positions])[0]

    def reset(self) -> None:
        self.program.reset()
        if self.cache is not None:
            self.cache.reset()


def coverage(path) -> dict:
    """Instructions of a program by name, and which of them the interpreter has no handler for."""
    prog = MLXProgram(path)
    counts: dict = {}
    for op in prog.ops():
        counts[op] = counts.get(op, 0) + 1
    return {"instructions": counts, "uncovered": sorted(op for op in counts if not Interpreter.covers(op))}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    bad = 0
    for p in argv:
        cov = coverage(p)
        print(f"{p}: {sum(cov['instructions'].values())} instructions, {len(cov['instructions'])} kinds")
        for op, c in sorted(cov["instructions"].items(), key=lambda x: -x[1]):
            print(f"  {op:<24} {c:5d}  {'ok' if Interpreter.covers(op) else 'UNSUPPORTED'}")
        bad += len(cov["uncovered"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
