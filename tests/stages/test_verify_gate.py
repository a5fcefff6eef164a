"""The verify gate fails a wrong program, with a decoded diff of the two token streams."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.stages import StageContext, verify
from tests.helpers import build, compose_cfg


def test_a_wrong_program_fails_the_gate(tmp_path):
    right = build("tiny_llama_xnnpack")
    # the same architecture with other weights: a program that runs fine but is not this model
    wrong = build("tiny_llama_xnnpack", "model.random.seed=1", "verify.enabled=false")
    entries = {s["name"]: Path(s["path"]) for s in right["stages"]}
    entries["lower"] = Path(next(s["path"] for s in wrong["stages"] if s["name"] == "lower"))
    cfg = compose_cfg("recipe=tiny_llama_xnnpack")
    ctx = StageContext(cfg=cfg, out=tmp_path, inputs=entries, progress=False)
    with pytest.raises(verify.VerifyFailed) as e:
        verify.run(ctx)
    msg = str(e.value)
    assert "greedy match" in msg and "eager:" in msg and ".pte:" in msg
    report = (tmp_path / "report.json").read_text()
    assert '"passed": false' in report


def test_the_right_program_passes_exactly():
    m = build("tiny_llama_xnnpack")
    same = m["verify"]["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] and same["max_logit_err"] < 1e-4


def test_the_dynamic_gate_measures_its_numerics_floor():
    """A tiny 8da4w build's report carries the floor; the program sits within the calibrated multiple of it."""
    m = build("tiny_llama_xnnpack_8da4w")
    s, th = m["verify"], compose_cfg("recipe=tiny_llama_xnnpack_8da4w").verify.dynamic.same_quant
    assert s["gate"] == "dynamic" and s["floor"]["kld"] > 0
    assert s["same_quant"]["kld"] <= th.max_kld_over_floor * s["floor"]["kld"] + 1e-4


def test_a_program_above_its_floor_fails():
    th = compose_cfg().verify.dynamic.same_quant
    summary = {"same_quant": {"kld": 0.05}, "floor": {"kld": 0.007}}
    problems = verify.floor_problems(summary, th)
    assert problems and "numerics floor" in problems[0]["problems"][0]
    assert verify.floor_problems({"same_quant": {"kld": 0.008}, "floor": {"kld": 0.007}}, th) == []
    assert verify.floor_problems({"same_quant": {"kld": 0.05}}, th) == []   # no floor measured: nothing to hold to


def test_float_noise_is_small_seeded_and_leaves_the_module_alone():
    import copy

    import torch
    from pipeline.model.cache_modes import wrap
    from pipeline.model.quant.float_noise import float_noise, with_float_noise
    from pipeline.model.loading import load_hf_model
    module = wrap(load_hf_model(build("tiny_llama_xnnpack", stages=("download",))["model_dir"]), "static", 64, "last")
    ids, pos = torch.tensor([[1, 5, 9, 3]]), torch.arange(4)
    with torch.no_grad():
        clean = module(ids, pos).clone()
        a = with_float_noise(module)(ids, pos)
        b = with_float_noise(module)(ids, pos)
        assert torch.equal(module(ids, pos), clean)   # the copies carry the hooks, not the module
        with float_noise(module, torch.Generator().manual_seed(123)):  # what verify does: the module, for a span
            c = module(ids, pos).clone()
        assert torch.equal(module(ids, pos), clean)   # the hooks are gone with the span
        # the span's noise is the copy's: on the same weights, bit for bit (a copy's freshly allocated weights can
        # give last-bit different matmuls than the loaded ones on some CPUs: 3.6e-7 on an AVX2 EPYC)
        twin = copy.deepcopy(module)
        with float_noise(twin, torch.Generator().manual_seed(123)):
            d = twin(ids, pos).clone()
    assert 0 < (a - clean).abs().max() < 1e-3 * clean.abs().max()
    assert 0 < (c - clean).abs().max() < 1e-3 * clean.abs().max()
    assert torch.equal(a, b) and torch.equal(a, d)
