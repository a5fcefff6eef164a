"""XNNPACK's partitioner with two of its look-ups made linear, the same partitions.

Why: on a decoder (SmolLM2: ~3000 nodes) two checks inside ExecuTorch's configuration partitioner grow with the square
of the graph:
- whether a node is constant data asks the graph signature's inputs_to_parameters / _buffers / _lifted_tensor_constants,
  properties that rebuild their dicts from every input spec at each call. During the match the program does not
  change: the three name sets are read once.
- before merging two partition groups, the group partitioner asks, for each user outside them, whether any node
  downstream of it is inside them, iterating over every downstream node. The downstream set is intersected with the
  groups' nodes instead (the same answer: is the intersection empty).
tests/exporters/test_lean_lowering.py holds programs lowered this way to the stock lowering's bytes.
"""
from __future__ import annotations

import contextlib

from executorch.exir.backend.canonical_partitioners import config_partitioner
from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner

ORIGINAL = {"is_constant_data": config_partitioner.is_constant_data,
            "get_matched_nodes_from_configs":
                config_partitioner.ConfigerationBasedPartitioner.get_matched_nodes_from_configs,
            "_can_merge_partitions": GroupBasedPartitioner._can_merge_partitions}


def constant_names(ep) -> frozenset:
    sig = ep.graph_signature
    return frozenset(sig.inputs_to_parameters) | frozenset(sig.inputs_to_buffers) | \
        frozenset(sig.inputs_to_lifted_tensor_constants)


def matched_nodes(self, ep):
    """get_matched_nodes_from_configs with the constant names read once for the match."""
    names = constant_names(ep)
    config_partitioner.is_constant_data = lambda program, node: (
        node.name in names if program is ep else ORIGINAL["is_constant_data"](program, node))
    try:
        return ORIGINAL["get_matched_nodes_from_configs"](self, ep)
    finally:
        config_partitioner.is_constant_data = ORIGINAL["is_constant_data"]


def can_merge(self, p1, p2, partitions_by_id):
    """_can_merge_partitions with each external user's downstream nodes cut to the two groups' nodes first."""
    combined = set(partitions_by_id[p1].nodes) | set(partitions_by_id[p2].nodes)
    viewer = self.dependency_viewer
    viewer.downstreams_of = lambda node: viewer.downstreams[node] & combined
    try:
        return ORIGINAL["_can_merge_partitions"](self, p1, p2, partitions_by_id)
    finally:
        del viewer.downstreams_of  # the class's method again


@contextlib.contextmanager
def lean_partition():
    config_partitioner.ConfigerationBasedPartitioner.get_matched_nodes_from_configs = matched_nodes
    GroupBasedPartitioner._can_merge_partitions = can_merge
    try:
        yield
    finally:
        config_partitioner.ConfigerationBasedPartitioner.get_matched_nodes_from_configs = \
            ORIGINAL["get_matched_nodes_from_configs"]
        GroupBasedPartitioner._can_merge_partitions = ORIGINAL["_can_merge_partitions"]
