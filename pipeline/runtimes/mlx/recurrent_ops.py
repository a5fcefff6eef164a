"""The MLX delegate's instructions of a recurrent layer (pipeline/backends/mlx/recurrent.py): the conv, the scan the
delegate gives the gated delta rule, and its Metal kernel read by its op's meaning, over `mlx.core` (a part of
ops.Interpreter, whose `run` a scan calls for its body chain)."""
from __future__ import annotations

from pipeline.runtimes.mlx.payload import UnsupportedInstruction, _mx
from pipeline.runtimes.mlx.payload import tid as _tid


class RecurrentOps:
    """Conv1D, ScanNode, and the gated_delta_step Metal kernel."""

    def op_Conv1DNode(self, n, st):
        """x [N, L, C_in] (channels last), w [C_out, K, C_in / groups] -> [N, L_out, C_out], as mx.conv1d."""
        st.t[_tid(n["out"])] = _mx().conv1d(st.tensor(n["x"]), st.tensor(n["w"]), stride=n.get("stride", 1),
                                            padding=n.get("padding", 0), dilation=n.get("dilation", 1),
                                            groups=n.get("groups", 1))

    def op_ScanNode(self, n, st):
        """For each index t of `scan_axis`: every `sliced` slot gets its original's slice t (that axis dropped), the
        body chain runs (reading and writing the `carry` slots in place), and each `outputs` slot's value is kept;
        after the last step each output slot holds the steps' values stacked along `scan_axis`."""
        mx = _mx()
        originals = [st.tensor(t) for t in n["originals"]]
        axis = n.get("scan_axis", 1)
        steps = originals[0].shape[axis]
        kept: list[list] = [[] for _ in n["outputs"]]
        for t in range(steps):
            for src, dst in zip(originals, n["sliced"]):
                st.t[_tid(dst)] = mx.take(src, t, axis=axis)
            self.run(self.graph, n["body_chain_idx"], st)
            for out, ys in zip(n["outputs"], kept):
                ys.append(st.tensor(out))
        for out, ys in zip(n["outputs"], kept):
            st.t[_tid(out)] = mx.stack(ys, axis=axis)

    def op_MetalKernelNode(self, n, st):
        """A Metal kernel cannot run here: the kernels the delegate emits are interpreted by name, with their op's
        meaning. gated_delta_step is mlx::gated_delta_rule's recurrence (q, k [B,T,Hk,Dk], v [B,T,Hv,Dv], decay g and
        beta [B,T,Hv], state [B,Hv,Dv,Dk] -> y [B,T,Hv,Dv], state_out), in the inputs' dtype."""
        if n["name"] != "gated_delta_step":
            raise UnsupportedInstruction(f"MetalKernelNode {n['name']!r}")
        mx = _mx()
        q, k, v, g, beta, state = (st.tensor(t) for t in n["inputs"][:6])
        rep = v.shape[2] // q.shape[2]
        if rep > 1:  # a key head serves Hv / Hk value heads, as the kernel's hk = hv / (Hv / Hk)
            q, k = mx.repeat(q, rep, axis=2), mx.repeat(k, rep, axis=2)
        ys = []
        for t in range(q.shape[1]):
            state = state * g[:, t, :, None, None]
            delta = (v[:, t] - (state * k[:, t, :, None, :]).sum(-1)) * beta[:, t, :, None]
            state = state + k[:, t, :, None, :] * delta[..., None]
            ys.append((state * q[:, t, :, None, :]).sum(-1))
        y_out, state_out = n["outputs"]
        st.t[_tid(y_out)] = mx.stack(ys, axis=1)
        st.t[_tid(state_out)] = state
