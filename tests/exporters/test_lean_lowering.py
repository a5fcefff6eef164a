"""The lower stage's lean lowering (pipeline/exporters/lean_edge.py: one decomposition, the edge passes chained;
pipeline/backends/xnnpack/lean_preprocess.py: the per-partition passes that cannot act skipped; the
one-decomposition partitioner) gives the stock ExecuTorch lowering's program, byte for byte."""
from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import build, compose_cfg, stage_path


def stock_lowering(ep, cfg) -> bytes:
    """ExecuTorch as it ships: XNNPACK's own partitioner class (with the project's configs), every pass."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from pipeline.backends import BACKENDS
    from pipeline.backends.xnnpack import weight_only
    backend = BACKENDS[cfg.backend.name]
    partitioners, passes = backend.partition()
    if cfg.backend.name == "xnnpack":
        partitioners = [XnnpackPartitioner(configs=weight_only.configs(), enable_bf16=True)]
    edge = to_edge_transform_and_lower(ep, partitioner=partitioners, transform_passes=passes,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                        _skip_dim_order=True))
    return edge.to_executorch(backend.executorch_config(cfg)).buffer


def mlx_names(buffer: bytes) -> bytes:
    """The MLX delegate prefixes its constants' names with 4 hex digits of a hash of the program's printed form,
    node names included: the one difference a lowering with other node names may make."""
    return re.sub(rb"(?<![0-9A-Za-z_])[0-9a-f]{4}/(?=[A-Za-z_])", b"xxxx/", buffer)


@pytest.mark.parametrize("recipe,overrides", [
    # CI lowers the off-graph and MLX cases; the two other XNNPACK cases are in the slow tier
    pytest.param("tiny_llama_custom", ("quantize=8da4w_mixed",), marks=pytest.mark.slow),  # dynamic acts, custom op
    ("tiny_gemma3_offgraph", ()),                        # fp32, rings, tanh GELU
    pytest.param("tiny_llama_xnnpack", ("quantize=8w",), marks=pytest.mark.slow),  # static cache, weight-only
    ("tiny_llama_xnnpack", ("backend=portable",)),       # no partitioner: the default decomposition table
    ("tiny_llama_mlx", ()),                              # the MLX partitioner and its passes
    ("tiny_llama_mlx", ("cache=static",)),               # ATen in-place ops: the stock decomposition
])
def test_lean_lowering_gives_the_stock_bytes(recipe, overrides):
    from pipeline.backends import BACKENDS
    from pipeline.backends.xnnpack.lean_preprocess import STATS as PREPROCESS
    from pipeline.exporters.lean_edge import STATS as EDGE
    from pipeline.exporters.native import lower_program
    from pipeline.runtimes.executorch import load_kernels
    load_kernels()
    m = build(recipe, *overrides, stages=("download", "wrap", "quantize", "export"))
    cfg = compose_cfg(f"recipe={recipe}", *overrides)
    path = stage_path(m, "export") / "program.pt2"
    BACKENDS[cfg.backend.name].setup()  # the ops the program calls (MLX's are registered by its package)
    ours = lower_program(torch.export.load(path), cfg, {})[0].buffer
    edge, preprocess = dict(EDGE), dict(PREPROCESS)
    stock = stock_lowering(torch.export.load(path), cfg)
    if cfg.backend.name == "mlx":
        ours, stock = mlx_names(ours), mlx_names(stock)
    assert ours == stock
    # HF's static cache writes with ATen in-place ops: the partitioner is asked on the functionalized form, as stock
    # (without a partitioner, the default table keeps nothing to ask about)
    stock_path = cfg.cache.mode == "static" and cfg.backend.name != "portable"
    assert edge["decompositions_saved"] == (0 if stock_path else 1) and edge["retraces_saved"] >= 5
    # each delegate call re-traced by its recorded shapes (without a partitioner there is none)
    assert (edge["delegates_by_shape"] > 0) == (cfg.backend.name != "portable")
    if recipe != "tiny_llama_xnnpack" and cfg.backend.name == "xnnpack":
        assert preprocess["lean"] == preprocess["partitions"] > 0
        assert preprocess["passes_skipped"] > preprocess["passes_run"]


def test_export_without_the_guard_cse_gives_the_same_program():
    """pipeline/exporters/lean_export.py: the same exported program, saved without the canonical form's self-test,
    byte for byte but for what differs between two stock exports of one module (the archive's random id, graphs'
    object ids in node provenance)."""
    import contextlib
    import io
    import zipfile

    from pipeline.exporters.lean_export import without_canonical_self_test
    from pipeline.exporters.native import export_program
    from pipeline.model.cache_modes import wrap
    from tests.model.test_offgraph import tiny_gemma3

    def saved(ep, lean: bool = False) -> dict:
        f = io.BytesIO()
        with without_canonical_self_test() if lean else contextlib.nullcontext():
            torch.export.save(ep, f)
        z = zipfile.ZipFile(f)
        return {n: re.sub(rb'graph_id\\+": \d+', b"graph_id", z.read(n)) for n in z.namelist()
                if not n.endswith("serialization_id")}

    def stock():
        T = torch.export.Dim("T", min=1, max=8)
        with torch.no_grad():
            return torch.export.export(module, (torch.zeros((1, 2), dtype=torch.long), torch.arange(2)),
                                       dynamic_shapes=({1: T}, {0: T}), strict=True)

    module = wrap(tiny_gemma3(), "custom", 64, "last", 8)
    first, ours, second = saved(stock()), saved(export_program(module, 8), lean=True), saved(stock())
    assert first == second  # what the normalization leaves is deterministic, so the comparison can fail
    assert ours == second
