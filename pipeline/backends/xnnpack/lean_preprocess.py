"""XNNPACK's per-partition preprocess without the passes that cannot change a partition.

Why: `XnnpackBackend.preprocess` runs 17 graph passes on every delegated partition, each a full re-trace and
validation, and on a decoder partition all but two or three find nothing to do (SmolLM2 8da4w: ~85 s of a 210 s
lowering). A pass is skipped only where a cheap look at the partition's ops proves it a no-op, checked right before
that pass (an earlier one can create what a later one matches); a partition holding any op outside the set these
proofs cover (convolutions, pooling, batch norm, pads, activations that fuse, softmax, dim-order ops, ...) runs
every pass, as stock ExecuTorch does. tests/exporters/test_lean_lowering.py holds the programs to the stock
lowering's bytes.
"""
from __future__ import annotations

import contextlib

import torch
from torch.fx import Node

from executorch.backends.transforms.addmm_mm_to_linear import get_dqlinear_input, get_shape
from executorch.backends.xnnpack import _passes, xnnpack_preprocess
from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from torch._ops import OpOverload

# The ops whose interaction with every pass the predicates below cover (format: `aten.linear.default`).
COVERED = {
    "aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.addmm.default",
    "aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor", "aten.div.Tensor", "aten.neg.default",
    "aten.rsqrt.default", "aten.sqrt.default", "aten.pow.Tensor_Scalar", "aten.exp.default", "aten.abs.default",
    "aten.sigmoid.default", "aten.tanh.default", "aten.gelu.default", "aten.cos.default", "aten.sin.default",
    "aten.view_copy.default", "aten.permute_copy.default", "aten.cat.default", "aten.clone.default",
    "aten.slice_copy.Tensor", "aten.unsqueeze_copy.default", "aten.squeeze_copy.dims", "aten.mean.dim",
    "aten._to_copy.default", "aten.maximum.default", "aten.minimum.default",
    "torchao.choose_qparams_affine.default", "torchao.quantize_affine.default", "torchao.dequantize_affine.default",
    "quantized_decomposed.choose_qparams.tensor", "quantized_decomposed.quantize_per_tensor.tensor",
    "quantized_decomposed.dequantize_per_tensor.tensor", "quantized_decomposed.dequantize_per_channel.default",
    "quantized_decomposed.dequantize_per_channel_group.default", "quantized_decomposed.quantize_per_token.default",
    "quantized_decomposed.dequantize_per_token.default", "quantized_decomposed.choose_qparams_per_token_asymmetric.default",
    "getitem",
}
NHWC_TRIGGERS = {"aten.mean.dim", "aten._to_copy.default"}  # of COVERED: what ChannelsLastTaggedReshapePass acts on


def op_name(n: Node) -> str:
    t = n.target
    if isinstance(t, (EdgeOpOverload, OpOverload)):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def _names(ep) -> set[str]:
    return {op_name(n) for n in ep.graph.nodes if n.op == "call_function"}


def _channels_last(ep) -> bool:
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == 4 and not val.is_contiguous():
            return True
    return False


def _constant_seed(ep) -> bool:
    """ConstPropPass folds from ops whose inputs are all get_attr constants (placeholders never are)."""
    return any(n.op == "call_function" and not (is_quant(n) or is_dequant(n))
               and all(a.op == "get_attr" for a in n.all_input_nodes) for n in ep.graph.nodes)


def _custom_meta(ep) -> bool:
    return any((is_quant(n) or is_dequant(n)) and isinstance(n.args[0], Node) and "custom" in n.args[0].meta
               for n in ep.graph.nodes)


def _linear_pattern(ep) -> bool:
    """ConvertToLinearPass acts on mm / addmm / bmm, on dead code, and on a linear between view_copys it can drop
    (asked with its own helpers: an input viewed from a static dequant, an output viewed to the shape it has); else
    it changes nothing, at the cost of two printed graphs and a re-trace (~30 % of a decoder's preprocess)."""
    view = "aten.view_copy.default"
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        if name in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default") or not (n.users or n.is_impure()):
            return True
        if name != "aten.linear.default":
            continue
        x = n.args[0]
        if get_dqlinear_input(x) not in (None, x):
            return True
        user = next(iter(n.users)) if len(n.users) == 1 else None
        if user is not None and op_name(user) == view:
            out = list(get_shape(x))
            out[-1] = n.args[1].meta["val"].shape[0]
            if out == list(get_shape(user)):
                return True
    return False


def _wide_cat(ep) -> bool:
    return any(op_name(n) == "aten.cat.default" and len(n.args[0]) > 5 for n in ep.graph.nodes)


# pass name -> whether it may act on a partition whose ops are all COVERED (None: always run)
MAY_ACT = {
    "XNNPACKRemoveCloneOpsTransform": lambda ep: "aten.clone.default" in _names(ep),
    "DimOrderOpsRevertPass": lambda ep: False,      # dim-order ops are not COVERED
    "ConvertToUpsampleBilinear2d": lambda ep: False,  # its patterns need index / upsample ops, not COVERED
    "ConvertToLinearPass": _linear_pattern,
    "PropagateCustomMetaPass": _custom_meta,
    "ConvertToSDPAPass": lambda ep: False,          # its patterns need _softmax, not COVERED
    "ConstPropPass": _constant_seed,
    "FuseBatchNormPass": lambda ep: False,
    "DecomposeBatchNorm": lambda ep: False,
    "FuseActivationPass": lambda ep: False,         # relu / hardtanh are not COVERED
    "DecomposeConcatenate": _wide_cat,
    "RemoveGetItemPass": lambda ep: False,          # max_pool2d_with_indices / max.dim are not COVERED
    "InsertPadQDQPass": lambda ep: False,
    "Conv1dUnsqueezePass": lambda ep: False,
    "PReLUReshapePass": lambda ep: False,
    "ChannelsLastTaggedReshapePass": lambda ep: bool(NHWC_TRIGGERS & _names(ep)) or _channels_last(ep),
    "RemoveRedundantCopyPass": lambda ep: "aten._to_copy.default" in _names(ep),
}
STATS = {"partitions": 0, "lean": 0, "passes_run": 0, "passes_skipped": 0}  # of the last lean_preprocess span


class LeanPassManager(_passes.XNNPACKPassManager):
    def transform(self):
        ep = self.exported_program
        STATS["partitions"] += 1
        if not _names(ep) <= COVERED or any(p.__name__ not in MAY_ACT for p in self.passes):
            return super().transform()
        STATS["lean"] += 1
        for pass_ in self.passes:
            may_act = MAY_ACT[pass_.__name__]
            if may_act is not None and not may_act(ep):
                STATS["passes_skipped"] += 1
                continue
            STATS["passes_run"] += 1
            ep = _passes._transform(ep, pass_(ep) if issubclass(pass_, _passes.XNNPACKPass) else pass_())
        return ep


@contextlib.contextmanager
def lean_preprocess():
    """XnnpackBackend.preprocess looks its pass manager up by name at each call: swapped for the span."""
    saved = xnnpack_preprocess.XNNPACKPassManager
    STATS.update(dict.fromkeys(STATS, 0))
    xnnpack_preprocess.XNNPACKPassManager = LeanPassManager
    try:
        yield STATS
    finally:
        xnnpack_preprocess.XNNPACKPassManager = saved
