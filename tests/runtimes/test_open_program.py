"""pipeline/runtimes: a lower entry opens as a program callable like the eager module, in the runtime its lower.json
names; runtime-owned caches (Python and C++) follow one step protocol."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.kv.layout import LayerSpec
from pipeline.model.kv.runtime_cache import OffgraphCache, OffgraphCacheError, run_step
from pipeline.runtimes import RUNTIMES, CachePolicy, Unsupported, open_program, program_info
from pipeline.runtimes.base import RunnerProgram, run_sequence
from pipeline.runtimes.native_cache import NativeOffgraphCache
from tests.helpers import build, stage_path


@pytest.fixture(scope="module")
def static_build():
    return build("tiny_llama_xnnpack")


@pytest.fixture(scope="module")
def offgraph_build():
    return build("tiny_gemma3_offgraph")


def test_lower_json_names_layout_runtime_and_kernels(static_build, offgraph_build):
    assert program_info(stage_path(static_build, "lower")) == {
        "layout": "runner", "file": "model.pte", "runtime": "executorch", "kernels": []}
    assert program_info(stage_path(offgraph_build, "lower"))["kernels"] == ["llmpipe"]


@pytest.mark.parametrize("which", ["static_build", "offgraph_build"])
def test_program_equals_its_eager_module(which, request):
    m = request.getfixturevalue(which)
    eager = torch.load(stage_path(m, "quantize") / "module.pt", weights_only=False)
    prog = open_program(stage_path(m, "lower"))
    assert isinstance(prog, RunnerProgram) and prog.chunk == m["config"]["export"]["prefill_chunk"]
    assert (prog.cache is not None) == (m["config"]["cache"]["mode"] == "offgraph")
    ids = list(range(3, 40))
    a = run_sequence(eager, ids, prog.chunk)
    b = run_sequence(prog, ids, prog.chunk)
    assert (a - b).abs().max().item() < 1e-3  # verify's exact gate (XNNPACK's summation order)
    assert prog.constant("get_max_context_len") == m["config"]["export"]["max_context_len"]


def test_the_cache_policy_sizes_the_runtime_cache(offgraph_build):
    prog = open_program(stage_path(offgraph_build, "lower"), policy=CachePolicy(capacity=40, windows=[0]))
    assert isinstance(prog.cache, NativeOffgraphCache)
    assert prog.cache.describe().endswith("3 layers: 3 flat")  # tiny gemma3: 2 sliding + 1 full, all flat now
    with pytest.raises(OffgraphCacheError, match="capacity 40"):
        run_sequence(prog, list(range(3, 50)), prog.chunk)


def test_a_program_outside_a_runtime_is_refused_whole(static_build):
    with pytest.raises(Unsupported, match="outside the MLX delegate"):
        open_program(stage_path(static_build, "lower"), runtime="mlx")


@pytest.mark.parametrize("cache_cls", [OffgraphCache, NativeOffgraphCache], ids=["python", "c++"])
def test_one_step_protocol_for_both_caches(cache_cls):
    """A refused step leaves no trace; a step before the length rewinds; the binding holds only while it runs."""
    cache = cache_cls([LayerSpec(1, 4, 4, window=4), LayerSpec(1, 4, 4)], capacity=12, max_write=4,
                      initial_capacity=4)
    ran = []
    run_step(cache, torch.arange(0, 4), lambda: ran.append(4))
    run_step(cache, torch.arange(4, 8), lambda: ran.append(8))
    assert cache.length == 8
    with pytest.raises(OffgraphCacheError, match="gap"):
        run_step(cache, torch.arange(9, 10), lambda: ran.append("never"))
    with pytest.raises(OffgraphCacheError, match="capacity 12"):
        run_step(cache, torch.arange(8, 13), lambda: ran.append("never"))
    assert cache.length == 8 and "never" not in ran
    run_step(cache, torch.arange(6, 8), lambda: ran.append("rerun"))  # rewinds to 6, then commits to 8
    assert cache.length == 8 and ran[-1] == "rerun"


def test_runtimes_are_the_registry():
    assert sorted(RUNTIMES) == ["executorch", "mlx"]
    assert RUNTIMES["executorch"].Cache is NativeOffgraphCache and RUNTIMES["mlx"].Cache is OffgraphCache
