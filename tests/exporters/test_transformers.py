"""export.exporter=transformers: transformers.exporters' prefill.pte + decode.pte pair, built through our stages and
verified in the Python runtime (pipeline/exporters/transformers.py, pipeline/runtimes/pair.py) on a tiny random Llama."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline import preflight
from pipeline.config import v
from pipeline.errors import ConfigError
from pipeline.exporters import transformers as route
from pipeline.runtimes import RUNTIMES
from pipeline.runtimes.mlx.program import coverage
from pipeline.runtimes.pair import DynamicCacheModule, PrefillDecodeModule, open_pair
from pipeline.store.key import config_slice
from pipeline.stages import ORDER, STAGES, StageContext, verify
from tests.helpers import build, compose_cfg, run_cli

RECIPE = "tiny_llama_hf_exporter"


@pytest.fixture(scope="module")
def built():
    m = build(RECIPE)
    assert m["status"] == "ok"
    return m


def _entries(m) -> dict[str, Path]:
    return {s["name"]: Path(s["path"]) for s in m["stages"]}


def test_route_builds_and_verifies_exactly(built):
    same = built["verify"]["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] > 0
    assert same["max_logit_err"] < 1e-4 and same["top1"] == 1.0
    lower = _entries(built)["lower"]
    assert Path(built["pte"]) == lower
    assert set(built["programs"]) == {"prefill", "decode"}
    for name in ("prefill.pte", "decode.pte", "export.json", "lower.json"):
        assert (lower / name).is_file()
    exported = json.loads((lower / "export.json").read_text())
    assert exported["export_format"] == "executorch" and set(exported["components"]) == {"prefill", "decode"}
    # the manifest says what was exported, by whom, and what quantization was handed over
    export = next(s for s in built["stages"] if s["name"] == "export")
    assert export["metrics"]["exporter"] == "transformers"
    assert export["metrics"]["quantization"]["exporter_quantizer"] is None
    lowered = json.loads((lower / "lower.json").read_text())
    assert lowered["constant_methods"]["get_max_seq_len"] == 16 and lowered["programs"]["decode"]["delegated_nodes"] > 0
    report = json.loads((_entries(built)["verify"] / "report.json").read_text())
    assert report["passed"] and "native" not in report["prompts"][0]


def test_two_program_layout_greedy_equals_eager(built):
    """Chunked prefill (prefill.pte, then decode.pte continuing with several tokens), then single decode steps."""
    entries = _entries(built)
    eager = torch.load(entries["wrap"] / "module.pt", weights_only=False)
    pte = PrefillDecodeModule(entries["lower"], RUNTIMES["executorch"])
    ids = torch.randint(3, 512, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    for chunk in (16, 5):  # 21 tokens: prefill 16 + a 5-token continuation; then 5 + 5 + 5 + 5 + 1
        ref, ref_logits = verify.greedy(eager, ids, 12, chunk, eos=set())
        got, got_logits = verify.greedy(pte, ids, 12, chunk, eos=set())
        assert got == ref and len(got) == 12
        assert max((a - b).abs().max().item() for a, b in zip(ref_logits, got_logits)) < 1e-4
    # a call at position 0 starts a new sequence: the same prompt again gives the same logits
    first = pte(torch.tensor([ids[:4]]), torch.arange(4))[0, -1]
    pte(torch.tensor([ids[4:9]]), torch.arange(4, 9))
    again = pte(torch.tensor([ids[:4]]), torch.arange(4))[0, -1]
    assert torch.equal(first, again)
    assert pte.constant("get_vocab_size") == 512


def test_decode_before_prefill_is_refused(built):
    pte = PrefillDecodeModule(_entries(built)["lower"], RUNTIMES["executorch"])
    with pytest.raises(RuntimeError, match="position 0"):
        pte(torch.tensor([[5]]), torch.tensor([3]))


@pytest.mark.slow  # CI breaks programs for the gate in tests/stages/test_gate_faults.py
def test_a_wrong_pair_fails_the_gate(built, tmp_path):
    wrong = build(RECIPE, "model.random.seed=1", "verify.enabled=false")
    entries = _entries(built)
    entries["lower"] = _entries(wrong)["lower"]
    ctx = StageContext(cfg=compose_cfg(f"recipe={RECIPE}"), out=tmp_path, inputs=entries, progress=False)
    with pytest.raises(verify.VerifyFailed, match="greedy match"):
        verify.run(ctx)


def test_exporter_changes_the_export_key_and_shares_download_wrap_quantize(built):
    native = compose_cfg(f"recipe={RECIPE}", "export.exporter=native")
    hf = compose_cfg(f"recipe={RECIPE}")
    # only the export stage's own config slice sees the exporter; lower and verify follow through their upstream key
    changed = [n for n in ORDER if config_slice(native, STAGES[n].CONFIG_KEYS) != config_slice(hf, STAGES[n].CONFIG_KEYS)]
    assert changed == ["export"]
    assert all("export" in STAGES[n].AFTER or "lower" in STAGES[n].AFTER for n in ("lower", "verify"))
    # so the native route reuses the same download, wrap, calibrate and quantize entries
    shared = build(RECIPE, "export.exporter=native", "export.strict=true", "verify.native=true", "run.until=quantize")
    assert [s["cache"] for s in shared["stages"]] == ["hit"] * 4
    assert [s["key"] for s in shared["stages"]] == [s["key"] for s in built["stages"][:4]]


# CI hands over the weight-only scheme (exact); 8da4w (the dynamic gate) is in the slow tier
@pytest.mark.parametrize("scheme", ["8w", pytest.param("8da4w", marks=pytest.mark.slow)])
def test_quantized_handover_verifies(scheme):
    """Our torchao quantize stage, handed over: weight-only is exact against eager torchao; 8da4w within the
    calibrated quantized thresholds."""
    m = build(RECIPE, f"quantize={scheme}")  # the gate follows the scheme: exact for 8w, dynamic for 8da4w
    assert m["status"] == "ok"
    q = next(s for s in m["stages"] if s["name"] == "export")["metrics"]["quantization"]
    assert q["linear"] == scheme and q["quantized_embeddings"] == 1
    if scheme == "8w":
        assert m["verify"]["same_quant"]["max_logit_err"] < 1e-4


def test_sweep_row_sizes_the_pair(built, tmp_path):
    from pipeline.report.sweep import job_row
    job = tmp_path / "job0"
    job.mkdir()
    (job / "manifest.json").write_text(Path(built["run_manifest"]).read_text())
    row = job_row(job)
    total = sum(Path(p).stat().st_size for p in built["programs"].values())
    assert row["status"] == "ok" and row["pte_mib"] == round(total / 2**20, 1) and row["token_match"]


# --- bad input: refused before any work, one message naming key, value and what is allowed -------------------

def test_unknown_exporter_is_rejected_by_hydra_with_the_allowed_values():
    r = run_cli(f"recipe={RECIPE}", "export.exporter=onnx", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    for needle in ("export.exporter", "onnx", "native", "transformers"):
        assert needle in out, out
    assert "stage=" not in out


def test_native_runner_check_is_refused_in_preflight():
    r = run_cli(f"recipe={RECIPE}", "verify.native=true", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out
    assert "verify.native=True" in out and "export.exporter=transformers" in out and "allowed: [false]" in out
    assert "stage=" not in out, "no stage may start on a rejected config"


def test_unsupported_combinations_are_all_reported_at_once():
    cfg = compose_cfg(f"recipe={RECIPE}", "backend=portable", "cache=offgraph", "export.logits_mode=last",
                      "export.strict=true", "export.prefill_chunk=1")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg)
    got = {key: value for key, value, _ in e.value.problems}
    assert got["backend.name"] == "portable" and got["cache.mode"] == "offgraph"
    assert got["export.logits_mode"] == "last" and got["export.strict"] is True
    assert got["export.prefill_chunk"] == 1  # (export.dtype per backend: tests/stages/test_half_precision.py)
    text = str(e.value)
    assert "no portable backend" in text and "allowed: ['xnnpack', 'mlx']" in text


def test_portable_and_sliding_window_models_are_refused():
    cfg = compose_cfg(f"recipe={RECIPE}", "backend=portable")
    with pytest.raises(ConfigError, match="no portable backend"):
        preflight.check(cfg)
    cfg = compose_cfg(f"recipe={RECIPE}", "model=tiny_gemma3", "export.prefill_chunk=8")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg)
    assert [p[0] for p in e.value.problems] == ["export.exporter"] and "sliding-window" in str(e.value)


def test_native_route_is_untouched_by_the_rules():
    cfg = compose_cfg("recipe=tiny_llama_xnnpack", "export.logits_mode=last", "export.strict=true")
    assert v(cfg.export.exporter) == "native"
    assert preflight.check(cfg) is not None  # what this route refuses, the native route builds


# --- backend=mlx: the exporter's DynamicCache layout, run by our MLX interpreter (pipeline/runtimes/mlx) -------------------------

RECIPE_MLX = "tiny_llama_hf_exporter_mlx"


@pytest.fixture(scope="module")
def built_mlx():
    m = build(RECIPE_MLX)
    assert m["status"] == "ok", m.get("error")
    return m


def test_mlx_route_builds_fully_delegated_and_verifies_exactly(built_mlx):
    v_ = built_mlx["verify"]
    assert v_["runtime"].startswith("pipeline.runtimes.mlx")
    same = v_["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] > 0
    assert same["max_logit_err"] < 1e-4 and same["top1"] == 1.0
    entries = _entries(built_mlx)
    exported = json.loads((entries["export"] / "hf_export.json").read_text())
    assert exported["backend"] == "mlx" and exported["exporter"]["cache"] == "DynamicCache"
    assert exported["components"]["decode"]["dynamic_past"] == [1, 63]
    lowered = json.loads((entries["lower"] / "lower.json").read_text())
    assert lowered["cache"] == "DynamicCache"
    for name in ("prefill", "decode"):
        prog = lowered["programs"][name]
        # one MLX delegate per program; only the delegate's getitem outputs are outside it
        assert prog["delegated_subgraphs"] == 1
        assert all(c["non_delegated"] == 0 for op, c in prog["by_op"].items() if op != "getitem"), prog["by_op"]
    assert set(built_mlx["programs"]) == {"prefill", "decode"}


def test_mlx_programs_instructions_are_all_covered_by_the_interpreter(built_mlx):
    lower = _entries(built_mlx)["lower"]
    for name in ("prefill.pte", "decode.pte"):
        cov = coverage(lower / name)
        assert cov["instructions"] and cov["uncovered"] == [], (name, cov)
        assert "SdpaNode" in cov["instructions"] and "AddmmNode" in cov["instructions"]


def test_mlx_dynamic_cache_layout_greedy_equals_eager(built_mlx):
    """Chunked prefill (prefill.pte, then decode.pte continuing with several tokens), then single steps; a call at
    an earlier position crops the grown cache, so reruns give the same logits."""
    entries = _entries(built_mlx)
    eager = torch.load(entries["wrap"] / "module.pt", weights_only=False)
    pte = open_pair(entries["lower"], RUNTIMES["mlx"])
    assert isinstance(pte, DynamicCacheModule)
    ids = torch.randint(3, 512, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    for chunk in (16, 5):
        ref, ref_logits = verify.greedy(eager, ids, 12, chunk, eos=set())
        got, got_logits = verify.greedy(pte, ids, 12, chunk, eos=set())
        assert got == ref and len(got) == 12
        assert max((a - b).abs().max().item() for a, b in zip(ref_logits, got_logits)) < 1e-4
    first = pte(torch.tensor([ids[:4]]), torch.arange(4))[0, -1]
    step = pte(torch.tensor([ids[4:9]]), torch.arange(4, 9))[0, -1]
    pte(torch.tensor([ids[9:12]]), torch.arange(9, 12))
    assert pte.length == 12
    assert torch.equal(step, pte(torch.tensor([ids[4:9]]), torch.arange(4, 9))[0, -1])  # crop to 4, rerun
    assert pte.length == 9 and all(c.shape[2] == 9 for c in pte.cache)
    assert torch.equal(first, pte(torch.tensor([ids[:4]]), torch.arange(4))[0, -1])
    with pytest.raises(ValueError, match="exported for 1..16"):
        pte(torch.tensor([ids[:17]]), torch.arange(17))
    with pytest.raises(RuntimeError, match="skips past the cache"):
        pte(torch.tensor([[5]]), torch.tensor([7]))
    with pytest.raises(RuntimeError, match="position 0"):
        open_pair(entries["lower"], RUNTIMES["mlx"])(torch.tensor([[5]]), torch.tensor([3]))


def test_mlx_pair_does_not_load_in_linux_executorch_runtime(built_mlx):
    """Why verify uses the interpreter here: the ExecuTorch runtime has no MLXBackend on Linux."""
    from executorch.runtime import Runtime
    if Runtime.get().backend_registry.is_available("MLXBackend"):
        pytest.skip("MLXBackend is registered (Apple Silicon): verify compares the real runtime too")
    with pytest.raises(RuntimeError, match="Failed to load method forward"):  # logged: MLXBackend is not registered
        DynamicCacheModule(_entries(built_mlx)["lower"], RUNTIMES["executorch"])


@pytest.mark.parametrize("scheme", ["4w", pytest.param("nvfp4", marks=pytest.mark.slow)])  # nvfp4 in the slow tier
def test_mlx_quantized_handover_verifies_exactly(scheme):
    """torchao's tensors go to the exporter unrewritten; the MLX partitioner makes QuantizedMatmulNode of them."""
    m = build(RECIPE_MLX, f"quantize={scheme}")  # weight-only: the exact gate
    assert m["status"] == "ok", m.get("error")
    assert m["verify"]["same_quant"]["max_logit_err"] < 1e-4
    q = next(s for s in m["stages"] if s["name"] == "export")["metrics"]["quantization"]
    assert q["linear"] == scheme and q["quantized_embeddings"] == 0 and list(q["linear_forms"].values()) == [15]
    cov = coverage(_entries(m)["lower"] / "decode.pte")
    assert cov["uncovered"] == [] and cov["instructions"]["QuantizedMatmulNode"] == 15


@pytest.mark.parametrize("recipe", [RECIPE_MLX, "tiny_llama_mlx"])  # both routes to mlx
def test_mlx_refuses_8da4w(recipe):
    cfg = compose_cfg(f"recipe={recipe}", "quantize=8da4w")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg)
    assert [p[0] for p in e.value.problems] == ["quantize.linear"] and "Missing out variants" in str(e.value)
    assert route.problems(compose_cfg(f"recipe={RECIPE_MLX}")) == []
    assert preflight.check(compose_cfg(f"recipe={RECIPE}", "quantize=8da4w"))  # xnnpack: fine
