"""The MLX delegate's elementwise math instructions that only some families' programs hold (a part of
ops.Interpreter): Apertus' xIELU (expm1), ERNIE 4.5 MoE's clamped normalization (clip), Mamba-2's cumulative
decay (cumsum), and their kin."""
from __future__ import annotations

from pipeline.runtimes.mlx.payload import _mx
from pipeline.runtimes.mlx.payload import tid as _tid


class MathOps:
    """Unary functions of mlx.core, and clip with either bound."""

    def _math(self, n, st, name: str):
        st.t[_tid(n["out"])] = getattr(_mx(), name)(st.tensor(n["x"]))

    def op_Expm1Node(self, n, st):
        self._math(n, st, "expm1")

    def op_ErfNode(self, n, st):
        self._math(n, st, "erf")

    def op_Log2Node(self, n, st):
        self._math(n, st, "log2")

    def op_Log10Node(self, n, st):
        self._math(n, st, "log10")

    def op_FloorNode(self, n, st):
        self._math(n, st, "floor")

    def op_CeilNode(self, n, st):
        self._math(n, st, "ceil")

    def op_SignNode(self, n, st):
        self._math(n, st, "sign")

    def op_ClipNode(self, n, st):  # either bound may be absent (a clamp(min=...))
        lo, hi = (st.tensor(n[k]) if n.get(k) is not None else None for k in ("a_min", "a_max"))
        st.t[_tid(n["out"])] = _mx().clip(st.tensor(n["x"]), lo, hi)

    def op_CumsumNode(self, n, st):  # Mamba-2's cumulative log decay
        axis = int(n.get("axis") or 0)
        st.t[_tid(n["out"])] = _mx().cumsum(st.tensor(n["x"]), axis=axis, reverse=bool(n.get("reverse", False)),
                                            inclusive=bool(n.get("inclusive", True)))

    def op_ScatterAddNode(self, n, st):  # Nemotron-H's router: its chosen expert groups marked (backends/mlx/gather.py)
        mx = _mx()
        x, idx, upd = st.tensor(n["x"]), st.tensor(n["indices"]), st.tensor(n["updates"])
        axis = int(n.get("axis") or 0) % x.ndim
        # put_along_axis with a sum: one index column at a time, so repeated indices add up
        for j in range(idx.shape[axis]):
            take = tuple(slice(j, j + 1) if d == axis else slice(None) for d in range(idx.ndim))
            cur = mx.take_along_axis(x, idx[take], axis=axis)
            x = mx.put_along_axis(x, idx[take], cur + upd[take], axis=axis)
        st.t[_tid(n["out"])] = x
