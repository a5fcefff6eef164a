"""End to end on the real models with backend=mlx: the programs build here and verify through our interpreter
(pipeline/runtimes/mlx) with greedy tokens equal to eager; every instruction their programs hold has a handler;
the off-graph gemma program matches eager past its 512-token window (rings wrapped). All in the slow tier (six
minutes of CI's budget for one real MLX build; CI builds the MLX route on tiny models: tests/backends/test_mlx.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.runtimes import open_program
from pipeline.runtimes.base import run_sequence
from pipeline.runtimes.mlx.ops import Interpreter
from pipeline.runtimes.mlx.program import MLXProgram
from tests.helpers import build_cli, stage_path

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def llama_int4() -> dict:
    return build_cli("llama_mlx_int4")


def _exact(m: dict) -> None:
    assert m["status"] == "ok"
    v = m["verify"]
    assert v["runtime"].startswith("pipeline.runtimes.mlx")
    same = v["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] >= 16  # the fixed prompts, token for token
    lower = next(s for s in m["stages"] if s["name"] == "lower")["metrics"]
    assert lower["delegated_subgraphs"] == 1
    assert all(c["non_delegated"] == 0 for op, c in lower["delegation_by_op"].items() if op != "getitem")


@pytest.mark.slow
def test_gemma3_mlx_offgraph_builds_and_verifies_through_the_interpreter(gemma3_mlx_offgraph):
    _exact(gemma3_mlx_offgraph)
    ops = set(MLXProgram(gemma3_mlx_offgraph["pte"]).ops())
    assert "UpdateAndAttendNode" in ops
    assert all(Interpreter.covers(op) for op in ops), sorted(op for op in ops if not Interpreter.covers(op))


@pytest.mark.slow
def test_llama_mlx_int4_builds_and_verifies_exactly(llama_int4):
    _exact(llama_int4)
    ops = MLXProgram(llama_int4["pte"]).ops()
    assert "QuantizedMatmulNode" in ops and all(Interpreter.covers(op) for op in ops)
    assert Path(llama_int4["pte"]).stat().st_size < 150 * 2**20  # 4-bit linears and embedding, re-tied head


@pytest.mark.slow
def test_gemma3_mlx_offgraph_past_the_window(gemma3_mlx_offgraph):
    """Chunk 128 (rings of 639 slots in the 1024 context) fed 700 tokens: the rings wrap, and the interpreter's
    logits track eager's."""
    m = gemma3_mlx_offgraph
    eager = torch.load(stage_path(m, "wrap") / "module.pt", weights_only=False)
    prog = open_program(stage_path(m, "lower"))
    ids = torch.randint(100, 200000, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    a = run_sequence(eager, ids, 128)
    b = run_sequence(prog, ids, 128)
    assert prog.cache.length == 700
    assert (a - b).abs().max().item() < 0.05
    assert int(a.argmax()) == int(b.argmax())
    for i, tok in enumerate([int(a.argmax())] * 4):  # decode steps on wrapped rings
        a = run_sequence(eager, [tok], 1, start=700 + i)
        b = run_sequence(prog, [tok], 1, start=700 + i)
        assert int(a.argmax()) == int(b.argmax())
