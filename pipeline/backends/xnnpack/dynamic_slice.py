"""Slices along a static dimension of a tensor whose token dimension is dynamic, inside the XNNPACK delegate.

Why: a fused projection (pipeline/model/layers/fused_projections.py) hands its members their columns of one output with
`slice_copy` on the last dimension of a [1, T, N] tensor. ExecuTorch's slice config refuses any tensor with a
symbolic dimension, and each refused slice would split the layer's delegate call in two. XNNPACK's static slice
takes a size of 0 as "the rest of this dimension" (from offset 0), which is what the dynamic dimension needs; the
sliced dimension itself stays static.
"""
from __future__ import annotations

from typing import cast

import torch
from executorch.backends.xnnpack.operators import node_visitor
from executorch.backends.xnnpack.partition.config.generic_node_configs import SliceCopyConfig
from executorch.backends.xnnpack.utils.utils import get_input_node


def _shape(node) -> list:
    return list(node.meta["val"].shape)


def _static_slice_of_dynamic_tensor(node: torch.fx.Node) -> bool:
    """A stride-1 slice of a static dimension, every symbolic dimension of its input unsliced."""
    dim = cast(int, node.args[1])
    stride = cast(int, node.args[4]) if len(node.args) > 4 else 1
    shape = _shape(get_input_node(node, 0))
    dim = dim % len(shape)
    symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    return stride == 1 and bool(symbolic) and dim not in symbolic and isinstance(shape[dim], int) \
        and "XNN_NHWC_NODE" not in node.meta


class DynamicSliceConfig(SliceCopyConfig):
    """The stock config, plus slices of a static dimension of a dynamic tensor (fp32 only: no quantized slices)."""

    def check_constraints(self, node: torch.fx.Node, ep) -> bool:
        if not _static_slice_of_dynamic_tensor(node):
            return super().check_constraints(node, ep)
        if not self.check_common_constraints(node, ep):
            return False
        return node.meta["val"].dtype == torch.float32 and get_input_node(node, 0).meta["val"].dtype == torch.float32


# the stock visitor's module name is bound to None (its registering decorator returns nothing): take it from the table
_STOCK_VISITOR = node_visitor._node_visitor_dict["aten.slice_copy.Tensor"]


class DynamicSliceVisitor(_STOCK_VISITOR):
    """The stock visitor; a symbolic dimension (never the sliced one, by DynamicSliceConfig) is written as size 0."""

    def define_node(self, node, xnn_graph, vals_to_ids, debug_handle) -> None:
        if all(isinstance(d, int) for d in _shape(get_input_node(node, 0))):
            return super().define_node(node, xnn_graph, vals_to_ids, debug_handle)
        from executorch.backends.xnnpack.serialization.xnnpack_graph_schema import XNNStaticSlice, XNode
        self.define_nodes_tensor_inputs_outputs(node, xnn_graph, vals_to_ids)
        shape = _shape(get_input_node(node, 0))
        dim = cast(int, node.args[1]) % len(shape)
        start = cast(int, node.args[2]) if len(node.args) > 2 and node.args[2] else 0
        if start < 0:
            start += shape[dim]
        offsets = [0] * len(shape)
        offsets[dim] = start
        sizes = [d if isinstance(d, int) else 0 for d in _shape(node)]
        xnn_graph.xnodes.append(XNode(
            xnode_union=XNNStaticSlice(num_dims=len(shape), offsets=offsets, sizes=sizes,
                                       input_id=vals_to_ids[get_input_node(node, 0)], output_id=vals_to_ids[node],
                                       flags=0),
            debug_handle=debug_handle))


node_visitor.register_node_visitor(DynamicSliceVisitor)
