"""ExecuTorch's ATen -> edge -> ExecuTorch conversion with fewer whole-program re-traces, same program bytes.

Why: each re-trace of a decoder program (every node through fake tensors with a symbolic T) costs ~10 s on
SmolLM2, and the stock conversion makes about a dozen that change nothing or could share one:
- `to_edge_transform_and_lower` functionalizes the program (run_decompositions({})), asks the partitioner which ops
  to keep, then decomposes with a table that keeps them (a second re-trace). When the partitioner's kept ops do not
  depend on the functionalized form (no per-node check: the path ExecuTorch itself calls reliable; no ATen
  in-place op that functionalizing would turn into an op it may keep, as MLX keeps HF's static cache's
  index_copy), decomposing with that table right away does both in one re-trace.
- The edge passes that map op by op (view ops to copies, t to t_copy, scalars to tensors, mixed dtypes to casts,
  ATen ops to edge ops) are ExportPass subclasses, each a re-trace. Their `call_operator`s chain through `super()`,
  so one class inheriting from several applies them in order in one re-trace (Python's MRO): two re-traces where
  there were seven, split where cheap graph passes (noops, empty tensors, redundant q/dq) ran between them.
- `LegalizePortableDimOrderPass` re-traces to act on five ops with a non-contiguous input; skipped when the
  program has none (SpecPropPass re-traces right after it anyway).
- A re-trace after partitioning (SpecPropPass) meets each delegate call, whose fake-tensor rule unlifts the
  partition into a module and runs every node of it again (a whole-program re-trace more). Where each output's
  sizes are constants or input sizes and its layout contiguous, they follow from the partition's recorded output
  shapes without running it; anything else runs it, as stock.
tests/exporters/test_lean_lowering.py holds programs lowered this way to the stock conversion's bytes.
"""
from __future__ import annotations

import contextlib

import torch
from executorch.exir.pass_base import ExportPass, PassResult
from executorch.exir.passes import remove_mixed_type_operators, replace_aten_with_edge_pass
from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import ReplaceBrokenOpsWithFunctionalOpsPass
from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass
from executorch.exir.program import _program
from torch._export.passes.replace_view_ops_with_view_copy_ops_pass import (
    _NON_FUNCTIONAL_OPS_TO_FUNCTIONAL_OPS, get_view_copy_of_view_op)
from torch._higher_order_ops.executorch_call_delegate import executorch_call_delegate
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

STATS = {"decompositions_saved": 0, "retraces_saved": 0, "delegates_by_shape": 0}  # of the last lean_edge span


class ViewCopyPass(ExportPass):
    """torch's ReplaceViewOpsWithViewCopyOpsPass as an ExportPass, so it chains with the others."""

    def call_operator(self, op, args, kwargs, meta):
        if op in _NON_FUNCTIONAL_OPS_TO_FUNCTIONAL_OPS:
            op = _NON_FUNCTIONAL_OPS_TO_FUNCTIONAL_OPS[op]
        elif not isinstance(op, HigherOrderOperator) and (copy := get_view_copy_of_view_op(op._schema)):
            op = copy
        return super().call_operator(op, args, kwargs, meta)


class FirstEdgePasses(ViewCopyPass, NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass,
                      ScalarToTensorPass, SymToTensorPass):
    """The op-by-op passes before the cheap graph passes, in ExecuTorch's order, in one re-trace."""


class LastEdgePasses(remove_mixed_type_operators.RemoveMixedTypeOperators, replace_aten_with_edge_pass.OpReplacePass):
    """RemoveMixedTypeOperators, then ATen ops to edge ops (OpReplacePass), in one re-trace."""


class Skip:
    """A pass folded into FirstEdgePasses / LastEdgePasses: where ExecuTorch runs it, nothing happens."""

    def __call__(self, gm):
        return PassResult(gm, False)


def edge_passes(config):
    """_program._get_aten_to_edge_passes with the op-by-op passes chained, the cheap graph passes as they were; the
    two passes _generate_edge_program adds around the list are folded in (Skip), so a list this does not recognise
    (another ExecuTorch) gets them back in their places: the stock sequence."""
    pre, post = ORIGINAL["_get_aten_to_edge_passes"](config)
    folded = (NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass, ScalarToTensorPass, SymToTensorPass,
              remove_mixed_type_operators.RemoveMixedTypeOperators)
    kept = [p for p in pre if not isinstance(getattr(p, "__wrapped__", p), folded)]
    first = getattr(kept[0], "__wrapped__", kept[0]) if kept else None
    if len(pre) - len(kept) != len(folded) or type(first).__name__ != "ReplaceSymSizeOpPass":
        return [ORIGINAL["ReplaceViewOpsWithViewCopyOpsPass"](), *pre, ORIGINAL["OpReplacePass"]()], post
    STATS["retraces_saved"] += 5
    return [kept[0], FirstEdgePasses(), *kept[1:], LastEdgePasses()], post


class LegalizeWhereNeeded(_program.LegalizePortableDimOrderPass):
    def __call__(self, gm):
        def needs(n):
            if n.op != "call_function" or n.target not in self._target_ops:
                return False
            x = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            return not isinstance(x, torch.Tensor) or tuple(x.dim_order()) != tuple(range(x.dim()))
        if any(needs(n) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes):
            return super().__call__(gm)
        STATS["retraces_saved"] += 1
        return PassResult(gm, False)


def _size(d, symbols: dict):
    """A recorded size in the current shape environment (None: neither a constant nor a bare input symbol)."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    return int(expr) if expr.is_number else symbols.get(expr) if expr.is_Symbol else None


def _contiguous(t: torch.Tensor) -> bool:
    """Strides a contiguous layout of these (symbolic) sizes has, compared as expressions (no guard is added)."""
    want = 1
    for d, st in zip(reversed(t.shape), reversed(t.stride())):
        expr = st.node.expr if isinstance(st, torch.SymInt) else st
        if expr != want:
            return False
        want = want * (d.node.expr if isinstance(d, torch.SymInt) else d)
    return True


def delegate_outputs(lowered_module, args) -> object | None:
    """A delegate call's outputs as empty tensors of the current fake mode, from the partition's recorded output
    shapes with its input symbols bound to `args`' sizes; None where that cannot be exact."""
    ep = lowered_module.original_module
    inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    if len(inputs) != len(args):
        return None
    symbols = {}
    for node, arg in zip(inputs, args):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(arg, torch.Tensor) or val.dim() != arg.dim():
            return None
        for d, new in zip(val.shape, arg.shape):
            if isinstance(d, int) or d.node.expr.is_number:
                if isinstance(new, torch.SymInt) or int(d) != new:
                    return None
            elif not (d.node.expr.is_Symbol and isinstance(new, torch.SymInt)):
                return None
            elif symbols.setdefault(d.node.expr, new).node.expr != new.node.expr:
                return None
    results = dict(zip((n.name for n in ep.graph.output_node().args[0]), ep.graph.output_node().args[0]))
    outs = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            continue
        val = results[spec.arg.name].meta.get("val") if spec.arg.name in results else None
        if not isinstance(val, torch.Tensor) or not _contiguous(val):
            return None
        sizes = [_size(d, symbols) for d in val.shape]
        if any(x is None for x in sizes):
            return None
        outs.append((sizes, val.dtype, val.device))
    return outs, ep.call_spec.out_spec


def delegate_by_shape(mode, lowered_module, *args):
    """executorch_call_delegate's fake-tensor rule: delegate_outputs where it can say, else the stock rule."""
    found = delegate_outputs(lowered_module, args)
    if found is None:
        return ORIGINAL["delegate_fake"](mode, lowered_module, *args)
    STATS["delegates_by_shape"] += 1
    outs, spec = found
    with mode:
        return pytree.tree_unflatten([torch.empty(s, dtype=dt, device=dev) for s, dt, dev in outs], spec)


ORIGINAL = {"_get_aten_to_edge_passes": _program._get_aten_to_edge_passes,
            "ReplaceViewOpsWithViewCopyOpsPass": _program.ReplaceViewOpsWithViewCopyOpsPass,
            "OpReplacePass": _program.OpReplacePass,
            "LegalizePortableDimOrderPass": _program.LegalizePortableDimOrderPass,
            "delegate_fake": executorch_call_delegate.python_key_table[FakeTensorMode]}


def inplace_aten_ops(ep) -> set:
    """ATen in-place ops in the program (HF's StaticCache: index_copy_, add_): functionalizing turns them into other
    ATen ops (index_copy, add) that a partitioner may keep, so its answer on this form could differ."""
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "aten" and n.target._schema.is_mutable}


def decompose_for(ep, partitioners: list):
    """The program decomposed once, keeping what the partitioner keeps, when that needs no per-node check and no
    pre-decomposition transform, and the program is functional but for custom ops, so the partitioner sees the ops
    it would see after functionalization (else unchanged: ExecuTorch's own path then runs); without a partitioner,
    with the default table (what ExecuTorch applies then)."""
    from executorch.exir.backend.partitioner import Partitioner
    table = _program._default_decomposition_table()
    if len(partitioners) > 1 or (partitioners and inplace_aten_ops(ep)):
        return ep
    if partitioners:
        p = partitioners[0]
        if type(p).transform_for_pre_decomposition is not Partitioner.transform_for_pre_decomposition:
            return ep
        ops, check = p.ops_to_not_decompose(ep)
        if check is not None:
            return ep
        for op in ops:
            table.pop(op, None)
    decomposed = ep.run_decompositions(table)
    decomposed._llmpipe_decomposed = frozenset(table)
    STATS["decompositions_saved"] += 1
    return decomposed


@contextlib.contextmanager
def lean_edge():
    """For the span: the decomposed program's functionalization is skipped, the edge passes are chained, the dim
    order pass runs where it can act, delegate calls are re-traced by shape. Use with decompose_for(ep, partitioners)
    before to_edge_transform_and_lower."""
    run_decompositions = torch.export.ExportedProgram.run_decompositions

    def skip_functionalizing_twice(self, decomp_table=None, *args, **kwargs):
        done = getattr(self, "_llmpipe_decomposed", None)  # set on decompose_for's output only
        if done is not None and decomp_table is not None and set(decomp_table) <= done:
            return self  # functional ATen, nothing of this table left to decompose
        return run_decompositions(self, decomp_table, *args, **kwargs)

    STATS.update(dict.fromkeys(STATS, 0))
    torch.export.ExportedProgram.run_decompositions = skip_functionalizing_twice
    _program._get_aten_to_edge_passes = edge_passes
    _program.ReplaceViewOpsWithViewCopyOpsPass = Skip
    _program.OpReplacePass = Skip
    _program.LegalizePortableDimOrderPass = LegalizeWhereNeeded
    executorch_call_delegate.python_key_table[FakeTensorMode] = delegate_by_shape
    try:
        yield STATS
    finally:
        torch.export.ExportedProgram.run_decompositions = run_decompositions
        executorch_call_delegate.python_key_table[FakeTensorMode] = ORIGINAL["delegate_fake"]
        for name, value in ORIGINAL.items():
            if name != "delegate_fake":
                setattr(_program, name, value)

