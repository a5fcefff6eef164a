"""model.adapter_mode=separate: a PEFT LoRA adapter kept apart from its base. The branches equal PEFT's own (unmerged)
forward, also beside a smoothed base; two adapters of one base share its entries up to quantize and one
foundation.ptd, verify in the Python runtime and the C++ runner; what cannot be kept apart is refused at preflight."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model import adapter
from pipeline.model.layers import lora
from tests.helpers import build, compose_cfg, stage_path

peft = pytest.importorskip("peft")
TINY = ("model=tiny_llama",)


def base_dir() -> Path:
    """The tiny Llama's download entry: the base every adapter here is trained on."""
    return stage_path(build(None, *TINY, stages=("download",)), "download") / "model"


def base_model(folder: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def lora_adapter(folder: Path, out: Path, seed: int, targets, **extra) -> Path:
    """A LoRA adapter of random weights (B too: PEFT starts B at zero); alpha small, as a fine-tune's update is."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 2, "target_modules": targets, "init_lora_weights": False,
                                **extra})
    peft.get_peft_model(base_model(folder), config).save_pretrained(out)
    return out


def ids(n: int = 24) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("extra", [{}, {"use_rslora": True},
                                   {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 7}}],
                         ids=["lora", "rslora", "patterns"])
def test_the_branches_are_peft_s_forward(tmp_path, extra):
    folder = base_dir()
    path = lora_adapter(folder, tmp_path / "a", 1, ["q_proj", "v_proj", "down_proj"], **extra)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base_model(folder), path)(ids()).logits
        model = base_model(folder)
        assert lora.attach(model, adapter.branches(str(path))) == 6
        got = model(ids()).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got - base_model(folder)(ids()).logits).abs().max() > 1e-2  # the adapter moved the model


def test_the_branches_follow_smoothing(tmp_path):
    """Beside a smoothed base (inputs divided into the norms, v's and up's rows divided before o and down), the
    branches from smoothing.pt's scales add what they add beside the unsmoothed base."""
    from types import SimpleNamespace

    from pipeline.model.quant.smoothing import activation_maxima, smooth
    folder = base_dir()
    path = lora_adapter(folder, tmp_path / "a", 2, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    cfg = SimpleNamespace(model=SimpleNamespace(adapter=str(path)))
    with torch.no_grad():
        want = base_model(folder)
        lora.attach_adapter(SimpleNamespace(model=want), cfg)
        smoothed = base_model(folder)
        inputs, rows = {}, {}
        smooth(smoothed, activation_maxima(smoothed, [ids()[0].tolist()]), 0.6, inputs, rows)
        assert {n.rsplit(".", 1)[-1] for n in rows} == {"v_proj", "up_proj"}
        torch.save({"input": inputs, "rows": rows}, tmp_path / "smoothing.pt")
        lora.attach_adapter(SimpleNamespace(model=smoothed), cfg, tmp_path / "smoothing.pt")
        plain = want(ids()).logits
        assert (smoothed(ids()).logits - plain).abs().max() <= 1e-5 * plain.abs().max()
        unfollowed = base_model(folder)  # the same branches without the scales: they would not add the same
        smooth(unfollowed, activation_maxima(unfollowed, [ids()[0].tolist()]), 0.6)
        lora.attach_adapter(SimpleNamespace(model=unfollowed), cfg)
        assert (unfollowed(ids()).logits - plain).abs().max() > 1e-3 * plain.abs().max()


def test_what_cannot_be_kept_apart_is_refused_at_preflight(tmp_path):
    from pipeline import preflight
    folder = base_dir()
    good = lora_adapter(folder, tmp_path / "good", 3, ["q_proj"])
    cases = {
        lora_adapter(folder, tmp_path / "dora", 3, ["q_proj"], use_dora=True): ("model.adapter", "DoRA"),
        lora_adapter(folder, tmp_path / "save", 3, ["q_proj"], modules_to_save=["lm_head"]):
            ("model.adapter", "modules_to_save"),
        lora_adapter(folder, tmp_path / "embed", 3, ["q_proj", "embed_tokens"]):
            ("model.adapter", "embed_tokens.* not a linear's lora_A"),
    }
    for path, (key, why) in cases.items():
        with pytest.raises(ConfigError, match=why) as err:
            preflight.check(compose_cfg(*TINY, f"model.adapter={path}", "model.adapter_mode=separate"))
        assert key in str(err.value)
        assert preflight.check(compose_cfg(*TINY, f"model.adapter={path}")) is not None  # it merges
    for override, why in [("backend=mlx", "backend=mlx: its delegate's payload holds the program's weights"),
                          ("export.exporter=transformers", "export.exporter=transformers: an adapter kept apart")]:
        with pytest.raises(ConfigError, match=why) as err:
            preflight.check(compose_cfg(*TINY, f"model.adapter={good}", "model.adapter_mode=separate", override))
        assert "model.adapter_mode" in str(err.value)


def _build(path: Path, *overrides: str) -> dict:
    return build(None, *TINY, f"model.adapter={path}", "model.adapter_mode=separate", "verify.max_new_tokens=8",
                 *overrides)


def test_two_adapters_share_their_base_s_entries_and_one_foundation(tmp_path):
    """The default quantization (GPTQ, smoothing): two adapters' builds share download..quantize and one
    foundation.ptd (one file in the store), each verified against its eager fine-tune, C++ tokens equal to Python's.
    The C++ runner finds the foundation beside the program, or where --data says; without it, it says so."""
    from pipeline import native
    folder = base_dir()
    builds = [_build(lora_adapter(folder, tmp_path / f"a{i}", 10 + i, targets))
              for i, targets in enumerate([["q_proj", "v_proj", "o_proj", "down_proj"], ["k_proj", "up_proj"]])]
    keys = [{s["name"]: s["key"] for s in m["stages"]} for m in builds]
    for name in ("download", "wrap", "calibrate", "quantize"):
        assert keys[0][name] == keys[1][name], name
    assert keys[0]["export"] != keys[1]["export"]
    lowered = [stage_path(m, "lower") for m in builds]
    records = [json.loads((d / "lower.json").read_text())["program"] for d in lowered]
    assert records[0]["data"] == ["foundation.ptd"] and records[0]["data_sha256"] == records[1]["data_sha256"]
    assert (lowered[0] / "foundation.ptd").stat().st_ino == (lowered[1] / "foundation.ptd").stat().st_ino
    for m in builds:
        assert m["status"] == "ok" and m["verify"]["native"]["token_parity"] is True
    # the program holds the branches, the foundation the rest: the program is small beside it
    assert (lowered[0] / "model.pte").stat().st_size < (lowered[0] / "foundation.ptd").stat().st_size
    # the runner away from the foundation: told where it is (renamed), or not
    away = tmp_path / "away"
    away.mkdir()
    shutil.copy(lowered[0] / "model.pte", away / "model.pte")
    shutil.copy(lowered[0] / "foundation.ptd", tmp_path / "base-weights.ptd")
    prompt = [5, 17, 42, 99]
    want = native.run(lowered[0] / "model.pte", None, prompt_ids=prompt, max_new_tokens=6)["generated_ids"]
    got = native.run(away / "model.pte", None, prompt_ids=prompt, max_new_tokens=6,
                     extra_args=["--data", str(tmp_path / "base-weights.ptd")])["generated_ids"]
    assert got == want
    with pytest.raises(native.NativeRunError, match="reads its weights from foundation.ptd .*--data"):
        native.run(away / "model.pte", None, prompt_ids=prompt, max_new_tokens=6)


def test_an_fp32_adapter_program_is_peft_s_forward(tmp_path):
    """Unquantized (K/V in fp32 too), the program (Python runtime, its foundation loaded from lower.json) computes
    PEFT's forward."""
    from pipeline.runtimes import open_program
    from pipeline.runtimes.base import run_sequence
    folder = base_dir()
    path = lora_adapter(folder, tmp_path / "a", 20, ["q_proj", "k_proj", "gate_proj", "o_proj"])
    m = _build(path, "quantize=none", "cache.kv_dtype=fp32", "verify.native=false")
    assert m["status"] == "ok"
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base_model(folder), path)(ids(40)).logits[0, -1]
    got = run_sequence(open_program(stage_path(m, "lower")), ids(40)[0].tolist(), 16)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
