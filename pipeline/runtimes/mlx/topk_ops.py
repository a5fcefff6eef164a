"""The MLX delegate's instructions of a mixture-of-experts layer (pipeline/backends/mlx/experts.py): the router's
top-k (MLX lowers torch.topk to partition, slice, sort and a reversal) and the experts' gather matmuls, with the
meaning of the backend's C++ handlers, over `mlx.core` (a part of ops.Interpreter)."""
from __future__ import annotations

from pipeline.runtimes.mlx.payload import _mx
from pipeline.runtimes.mlx.payload import tid as _tid


class TopKOps:
    """Sorting along an axis, and matmuls whose right operand is gathered by index (a token's experts)."""

    def op_SortNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().sort(st.tensor(n["x"]), axis=n.get("axis", -1))

    def op_ArgsortNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().argsort(st.tensor(n["x"]), axis=n.get("axis", -1))

    def op_PartitionNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().partition(st.tensor(n["x"]), st.int(n["kth"]), axis=n.get("axis", -1))

    def op_ArgPartitionNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().argpartition(st.tensor(n["x"]), st.int(n["kth"]), axis=n.get("axis", -1))

    @staticmethod
    def _indices(n, st, key):
        return st.tensor(n[key]) if n.get(key) is not None else None

    def op_GatherMmNode(self, n, st):
        st.t[_tid(n["out"])] = _mx().gather_mm(st.tensor(n["a"]), st.tensor(n["b"]),
                                               lhs_indices=self._indices(n, st, "lhs_indices"),
                                               rhs_indices=self._indices(n, st, "rhs_indices"))

    def op_GatherQmmNode(self, n, st):
        biases = st.tensor(n["biases"]) if n.get("biases") is not None else None
        st.t[_tid(n["out"])] = _mx().gather_qmm(
            st.tensor(n["x"]), st.tensor(n["w"]), st.tensor(n["scales"]), biases,
            lhs_indices=self._indices(n, st, "lhs_indices"), rhs_indices=self._indices(n, st, "rhs_indices"),
            transpose=bool(n.get("transpose", True)), group_size=n["group_size"], bits=n["bits"],
            mode=n.get("mode", "affine"))
