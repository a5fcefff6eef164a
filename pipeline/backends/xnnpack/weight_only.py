"""Weight-only quantized linears that XNNPACK runs correctly.

Why: with the stock partitioner, `linear(x_fp32, dequantize_affine(w_int, scale))` is decomposed to
addmm, the addmm is delegated as an fp32 matmul, and XNNPACK's ConvertToLinearPass rebuilds the
linear from the raw integer weight, dropping the dequantize: the scale is never applied and the
program is wrong without a warning (max error ~300 for int4, ~4000 for int8 on outputs of ~2).

What this module does instead:
- SafeAddmm/SafeMM configs refuse a matmul whose weight comes from a dequantize, so the bug can
  never silently recur (such a linear fails loudly at to_executorch instead).
- WeightOnlyLinearConfig delegates per-channel symmetric int8 linears (and int4 per-channel,
  expressed with quantized_decomposed.dequantize_per_channel) as XNNPACK f32 x qc8w/qc4w FCs.
- Group-wise weight-only linears have no XNNPACK kernel with fp32 activations (qb4w needs dynamically
  quantized inputs), so they are swapped to `quantized_decomposed::mixed_linear`, a portable CPU
  kernel: correct, but slow.
"""
from __future__ import annotations

import torch
from torch import nn

from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
from executorch.backends.xnnpack.partition.config.gemm_configs import AddmmConfig, LinearConfig, MMConfig
from executorch.backends.xnnpack.partition.config.generic_node_configs import GeluConfig, SliceCopyConfig
from executorch.backends.xnnpack.partition.config.node_configs import MaxDimConfig
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.backends.xnnpack.utils.quant_utils import (
    is_affine_qdq, is_dequant, is_per_channel, is_per_channel_group, tag_as_implicit_q_dq)
from executorch.backends.xnnpack.utils.utils import get_input_node, get_param_tensor, is_param_node
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import PassResult


def _weight_from_dequant(node, idx) -> bool:
    """Follow single-input ops (permute/view/clone) back from node.args[idx] to a dequantize."""
    cur = node.args[idx]
    while isinstance(cur, torch.fx.Node) and cur.op == "call_function":
        if is_dequant(cur):
            return True
        ins = cur.all_input_nodes
        if len(ins) != 1:
            return False
        cur = ins[0]
    return False


class SafeAddmmConfig(AddmmConfig):
    def check_constraints(self, node, ep):
        if _weight_from_dequant(node, self.weight_idx) and not is_dequant(get_input_node(node, self.act_idx)):
            return False  # a weight-only quantized matmul delegated as fp32 would drop its scales
        return super().check_constraints(node, ep)


class SafeMMConfig(MMConfig):
    def check_constraints(self, node, ep):
        if _weight_from_dequant(node, self.weight_idx) and not is_dequant(get_input_node(node, self.act_idx)):
            return False
        return super().check_constraints(node, ep)


class WeightOnlyLinearConfig(LinearConfig):
    """linear(x_fp32, dq(w_q, s, 0)) -> an XNNPACK FC with fp32 activations and per-channel weights."""

    def _is_weight_only(self, node) -> bool:
        return is_dequant(get_input_node(node, self.weight_idx)) and \
            not is_dequant(get_input_node(node, self.act_idx))

    def check_constraints(self, node, ep):
        if not self._is_weight_only(node):
            return super().check_constraints(node, ep)
        if not self.check_common_constraints(node, ep):
            return False
        dq = get_input_node(node, self.weight_idx)
        if not is_param_node(ep, get_input_node(dq, 0)) or not (is_per_channel(dq) or is_per_channel_group(dq)):
            return False
        from executorch.backends.xnnpack.operators.quant_params import QuantParams
        try:
            qp = QuantParams.from_weights(dq, ep)
        except Exception:
            return False
        # only per-channel int8 storage runs with fp32 activations (f32_qc8w / f32_qc4w)
        if qp is None or not qp.per_channel or qp.per_channel_group or qp.dtype != torch.int8:
            return False
        # XNNPACK channelwise weights are symmetric: a non-zero zero point would be silently dropped
        zp_node = dq.args[3] if is_affine_qdq(dq) else dq.args[2]
        if isinstance(zp_node, torch.fx.Node):
            zp = get_param_tensor(ep, zp_node)
            if zp is None:
                return False
            from torch._subclasses.fake_tensor import FakeTensor
            if not isinstance(zp, FakeTensor) and bool((zp != 0).any()):
                return False
        return True

    def get_node_and_deps(self, node, ep):
        if not self._is_weight_only(node):
            return super().get_node_and_deps(node, ep)
        dq = get_input_node(node, self.weight_idx)
        tag_as_implicit_q_dq(dq)
        deps = [node, dq, get_input_node(dq, 0), *dq.all_input_nodes[1:3]]
        if len(node.args) > 2 and node.args[2] is not None:
            deps.append(get_input_node(node, 2))
        return deps


class ExactGeluConfig(GeluConfig):
    """XNNPACK's GELU is the erf form: its serializer drops `approximate`, so the tanh GELU of Gemma's MLPs
    (gelu_pytorch_tanh) would be computed as another function (a 1e-3 logit error on a tiny random Gemma 4).
    It stays outside the delegate, on the portable kernel that honours `approximate`."""

    def check_constraints(self, node: torch.fx.Node, ep) -> bool:
        if node.kwargs.get("approximate", "none") != "none":
            return False
        return super().check_constraints(node, ep)


class LastDimMaxConfig(MaxDimConfig):
    """max.dim over dim 2 or 3 of a 4-d tensor, written so: XNNPACK's serializer compares the dim as written, so a
    max over dim -1 (gpt-oss's eager attention with sinks) passes the stock check and then fails the lowering
    ("amax.default only supports dim == 2 or dim == 3"). Other dims stay on the portable kernel."""

    def check_constraints(self, node: torch.fx.Node, ep) -> bool:
        return len(node.args) > 1 and node.args[1] in (2, 3) and super().check_constraints(node, ep)


class OneDecompositionPartitioner(XnnpackPartitioner):
    """XNNPACK's partitioner, minus a redundant whole-graph decomposition.

    Why: a partitioner that hands `to_edge_transform_and_lower` a per-node check (XNNPACK's does) gets two extra
    decompositions of the whole program: one keeping the ops it asked to keep, then one with the full table after
    hiding the kept nodes its check accepts, to decompose the kept nodes it refuses. When it refuses none of them,
    that second pass changes nothing but costs a re-trace (SmolLM2: ~30 s); answering without the check then takes
    ExecuTorch's one-decomposition path, with the same ops kept. The same answer serves the final check, which
    then holds every kept node the check would accept to having been delegated, as before. Quantize / dequantize
    primitives are neither decomposed nor held by that check, so theirs do not count."""

    def ops_to_not_decompose(self, ep):
        from executorch.exir.operator.util import _QUANT_PRIMITIVES
        from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose
        ops, check = super().ops_to_not_decompose(ep)
        if check is None:
            return ops, check
        kept = set(ops) - set(_QUANT_PRIMITIVES)
        graph = ep.graph_module
        nested = any(isinstance(m, torch.fx.GraphModule) for m in graph.children())  # control flow: stock path
        refused = any(n.op == "call_function" and getattr(n.target, "_op", n.target) in kept and not check(n)
                      for n in graph.graph.nodes)  # an edge op's ATen overload is its _op
        if nested or refused:
            return ops, check
        return _remove_invalid_ops_for_not_decompose(list(ops)), None


def configs() -> list:
    """XNNPACK's partitioner configs with this module's safe ones in place of the stock ones."""
    from pipeline.backends.xnnpack.dynamic_slice import DynamicSliceConfig
    swap = {AddmmConfig: SafeAddmmConfig, MMConfig: SafeMMConfig, LinearConfig: WeightOnlyLinearConfig,
            GeluConfig: ExactGeluConfig, SliceCopyConfig: DynamicSliceConfig, MaxDimConfig: LastDimMaxConfig}
    return [swap.get(c, c) for c in ALL_PARTITIONER_CONFIGS]


def partitioner() -> XnnpackPartitioner:
    return OneDecompositionPartitioner(configs=configs(), enable_bf16=True)


def split_weight_only_linear_bias(gm: torch.fx.GraphModule) -> PassResult:
    """linear(x, dq(w), b) -> add(linear(x, dq(w)), b): XNNPACK refuses a bias beside a quantized
    weight when the input is fp32."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != exir_ops.edge.aten.linear.default:
            continue
        if len(n.args) < 3 or n.args[2] is None:
            continue
        w, x = n.args[1], n.args[0]
        if not (isinstance(w, torch.fx.Node) and is_dequant(w)) or (isinstance(x, torch.fx.Node) and is_dequant(x)):
            continue
        bias = n.args[2]
        with gm.graph.inserting_after(n):
            add = gm.graph.call_function(exir_ops.edge.aten.add.Tensor, (n, bias))
        n.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
        n.args = n.args[:2]
        add.meta = dict(n.meta)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


# --- module swaps, applied to the quantized eager module before torch.export -----------------------

def _parts(w) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 qdata [N, K] and scales ([N] per channel, [N, K/g] per group) of a torchao weight."""
    if list(w.block_size)[0] != 1:
        raise ValueError(f"unsupported weight block size {w.block_size}")
    if w.zero_point is not None and bool((w.zero_point != 0).any()):
        raise ValueError("weight-only linears on xnnpack need symmetric weights (zero points 0)")
    scale = w.scale
    if scale.dim() == 2 and scale.shape[1] == 1:
        scale = scale[:, 0]
    return w.qdata, scale


class DQPerChannelLinear(nn.Module):
    """Per-channel weights as quantized_decomposed.dequantize_per_channel: XNNPACK emits qc8w/qc4w."""

    def __init__(self, qdata, scale, bias, qmin: int, qmax: int):
        super().__init__()
        self.register_buffer("qweight", qdata.contiguous())
        self.register_buffer("scales", scale.to(torch.float32).contiguous())
        self.register_buffer("zero_points", torch.zeros_like(scale, dtype=torch.int64))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.qmin, self.qmax = qmin, qmax

    def forward(self, x):
        w = torch.ops.quantized_decomposed.dequantize_per_channel.default(
            self.qweight, self.scales, self.zero_points, 0, self.qmin, self.qmax, torch.int8)
        return nn.functional.linear(x, w, self.bias)


class MixedLinear(nn.Module):
    """Group-wise weights through quantized_decomposed::mixed_linear (portable CPU kernel). Its scales keep the
    activations' dtype: the kernel refuses fp16 activations beside fp32 scales (error 0x12 at run time)."""

    def __init__(self, qdata, scale, bias, out_features: int):
        super().__init__()
        self.register_buffer("qweight", qdata.contiguous())
        self.register_buffer("scales", scale.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features = out_features

    def forward(self, x):
        shape = x.shape
        # one sequence: squeeze, not reshape; reshaping logits mode tail's min(K, T) rows adds a guard export cannot
        # prove (1 % min(K, T) != 0)
        one = x.dim() == 3 and shape[0] == 1
        y = torch.ops.quantized_decomposed.mixed_linear.default(x.squeeze(0) if one else x.reshape(-1, shape[-1]),
                                                                self.qweight, self.scales, None)
        y = y.unsqueeze(0) if one else y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _register_mixed_linear() -> None:
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the op)
    import executorch.kernels.quantized  # noqa: F401  (its .out variant)
    op = torch.ops.quantized_decomposed.mixed_linear.default
    if getattr(op, "_pipeline_impl", False):
        return
    lib = torch.library.Library("quantized_decomposed", "IMPL")

    def ref(input, weight, weight_scales, weight_zero_points=None, dtype=None):
        n = weight.shape[1]
        if weight_scales.dim() == 2:
            g = (n + weight_scales.shape[1] - 1) // weight_scales.shape[1]
            s = weight_scales.repeat_interleave(g, dim=1)[:, :n]
        else:
            s = weight_scales[:, None]
        out = input @ (weight.to(input.dtype) * s).t()
        return out.to(dtype) if dtype is not None else out

    def meta(input, weight, weight_scales, weight_zero_points=None, dtype=None):
        return input.new_empty((input.shape[0], weight.shape[0]), dtype=dtype or input.dtype)

    lib.impl("mixed_linear", ref, "CompositeExplicitAutograd")
    lib.impl("mixed_linear", meta, "Meta")
    _register_mixed_linear.lib = lib  # keep the registration alive
    op._pipeline_impl = True


def prepare_weight_only_linears(model: nn.Module, bits: int) -> dict:
    """Swap torchao weight-only linears for forms XNNPACK (or the portable kernels) run correctly."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (quantized_decomposed.dequantize_per_channel)
    qmin, qmax = (-8, 7) if bits == 4 else (-128, 127)
    counts = {"xnnpack_per_channel": 0, "mixed_linear": 0}
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, nn.Linear) and hasattr(child.weight, "qdata")) or \
                    getattr(child.weight, "activation_quantization", None) is not None:
                continue
            qdata, scale = _parts(child.weight)
            if scale.dim() == 1:
                setattr(parent, name, DQPerChannelLinear(qdata, scale, child.bias, qmin, qmax))
                counts["xnnpack_per_channel"] += 1
            else:
                _register_mixed_linear()
                setattr(parent, name, MixedLinear(qdata, scale, child.bias, child.out_features))
                counts["mixed_linear"] += 1
    return counts
