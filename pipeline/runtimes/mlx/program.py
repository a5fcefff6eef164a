"""An MLX-delegated .pte, run by the interpreter: its delegate calls in order, each payload with its constants
(from the program's named data) and its mutable buffers (an in-graph KV cache: zero at the start, persistent
across calls). Constant methods are read from the program itself."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipeline.abi import SCALAR_TYPES
from pipeline.runtimes.mlx.ops import Interpreter, State
from pipeline.runtimes.mlx.payload import Graph, UnsupportedInstruction, _mx, decode_payload, mx_dtype, np_dtype, to_mx, to_torch


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
            arr = np.frombuffer(named_data[name], dtype=np_dtype(meta.scalar_type)).reshape(meta.shape)
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
        self.method_names = set(self.plans)
        self.program = program
        self.interp = Interpreter()
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

    def input_meta(self, method: str = "forward") -> list[tuple[tuple, int]]:
        """Each input's declared sizes and ScalarType code, read from the plan."""
        plan = self.plans[method]
        return [(tuple(int(x) for x in plan.values[j].val.sizes), int(plan.values[j].val.scalar_type))
                for j in plan.inputs]

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
        dtype = SCALAR_TYPES[int(t.scalar_type)]
        if not buf:  # the constant segment
            seg = self.program.constant_segment
            raise UnsupportedInstruction("constant method tensor in a segment", str(seg))
        numel = int(np.prod(list(t.sizes))) if len(t.sizes) else 1
        data = bytearray(buf[:numel * torch.empty((), dtype=dtype).element_size()])  # storage is padded
        return torch.frombuffer(data, dtype=dtype).reshape(list(t.sizes)).clone()

    def execute(self, inputs: Sequence, method: str = "forward") -> list:
        if method != "forward":
            raise UnsupportedInstruction(f"method {method}", "only forward runs MLX delegate calls")
        values: dict = {i: x for i, x in zip(self.plan.inputs, inputs)}
        for delegate, args in self.calls:
            n_in = len(delegate.graph.inputs)
            outs = delegate.execute(self.interp, [values[i] for i in args[:n_in]])
            for i, o in zip(args[n_in:], outs):
                values[i] = o
        return [to_torch(values[i]) if not isinstance(values[i], (int, torch.Tensor)) else values[i]
                for i in self.plan.outputs]

    def reset(self) -> None:
        for delegate, _ in self.calls:
            delegate.reset()

    def snapshot(self) -> list:
        """The mutable buffers (an in-graph cache, a recurrent state) as they are: mlx arrays are immutable, so
        holding them is a snapshot."""
        return [dict(delegate.buffers) for delegate, _ in self.calls]

    def restore(self, snap: list) -> None:
        for (delegate, _), buffers in zip(self.calls, snap):
            delegate.buffers = dict(buffers)


def coverage(path) -> dict:
    """Instructions of a program by name, and which of them the interpreter has no handler for."""
    prog = MLXProgram(path)
    counts: dict = {}
    for op in prog.ops():
        counts[op] = counts.get(op, 0) + 1
    return {"instructions": counts, "uncovered": sorted(op for op in counts if not Interpreter.covers(op))}
