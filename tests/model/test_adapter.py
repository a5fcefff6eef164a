"""model.adapter: a PEFT LoRA adapter merged into the weights at download (pipeline/model/adapter.py), against PEFT's
own forward of the adapter on the base; refused at preflight where it cannot merge; a whole build of a fine-tune."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model import adapter
from tests.helpers import compose_cfg

peft = pytest.importorskip("peft")


def base_model(tmp_path: Path, arch: str = "llama") -> tuple[Path, object]:
    """A tiny random model saved as a checkpoint (the download stage's random source)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.model import sources
    cfg = compose_cfg("model=tiny_llama", f"model.random.arch={arch}")
    d = dict(sources.random_hf_config(cfg.model.random))
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    return folder, model


def lora(model, folder: Path, targets, **extra) -> Path:
    """A LoRA adapter of random weights (B too: PEFT starts B at zero, which would merge to nothing)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **extra)
    torch.manual_seed(1)
    tuned = peft.get_peft_model(model, config)
    tuned.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("targets,extra", [(["q_proj", "v_proj", "down_proj"], {}),
                                           ("all-linear", {"use_rslora": True}), (["k_proj", "up_proj"], {"use_dora": True})],
                         ids=["lora", "rslora-all-linear", "dora"])
def test_the_merged_checkpoint_is_peft_s_forward(tmp_path, targets, extra):
    from transformers import AutoModelForCausalLM
    folder, model = base_model(tmp_path)
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    base_logits = model(ids).logits
    path = lora(model, tmp_path / "adapter", targets, **extra)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), path)(ids).logits
    info = adapter.merge(folder, str(path))
    got = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
    assert (got - want).abs().max() < 1e-4
    assert (got - base_logits).abs().max() > 1e-2  # the adapter moved the model
    assert info["adapter_rank"] == 4
    assert [f.name for f in adapter.files(str(path))] == ["adapter_config.json", "adapter_model.safetensors"]


def test_an_adapter_that_cannot_merge_is_refused_at_preflight(tmp_path):
    from pipeline import preflight
    folder, model = base_model(tmp_path)
    good = lora(model, tmp_path / "adapter", ["q_proj"])
    cases = {tmp_path / "missing": "not a folder", tmp_path: "has no adapter_config.json"}
    wrong_type = tmp_path / "ia3"
    wrong_type.mkdir()
    (wrong_type / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "target_modules": ["q_proj"]}))
    (wrong_type / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    cases[wrong_type] = "peft_type 'IA3' is not merged by this pipeline: allowed \\['LORA'\\]"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = json.loads((good / "adapter_config.json").read_text())
    (elsewhere / "adapter_config.json").write_text(json.dumps(dict(config, target_modules=["c_attn"])))
    (elsewhere / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    cases[elsewhere] = "target_modules \\['c_attn'\\] name no linear of this model"
    for path, why in cases.items():
        cfg = compose_cfg("model=tiny_llama", f"model.adapter={path}")
        with pytest.raises(ConfigError, match=why) as err:
            preflight.check(cfg)
        assert "model.adapter" in str(err.value)
    cfg = compose_cfg("model=tiny_llama", f"model.adapter={good}")
    assert preflight.check(cfg) is not None


@pytest.mark.slow
def test_a_fine_tune_builds_verifies_and_rebuilds_when_its_adapter_changes(tmp_path):
    """A tiny base's download, a LoRA adapter trained on its layout (random), the whole build with it merged."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.session import build
    base = compose_cfg("model=tiny_llama", "run.until=download", "run.progress=false")
    m = build(base, recipe="adapter base")
    model_dir = Path(next(s["path"] for s in m["stages"] if s["name"] == "download")) / "model"
    path = lora(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter", ["q_proj", "up_proj"])
    cfg = compose_cfg("model=tiny_llama", f"model.adapter={path}", "run.progress=false", "verify.max_new_tokens=8")
    m = build(cfg, recipe="adapter fine-tune")
    assert m["status"] == "ok" and m["verify"]["native"]["token_parity"] is True
    download = next(s for s in m["stages"] if s["name"] == "download")
    assert download["key"] != next(s for s in build(base, recipe="adapter base")["stages"])["key"]
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), path).merge_and_unload()
    merged = load_file(Path(download["path"]) / "model" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged[name], want.state_dict()[name])
    # an edited adapter is another download entry
    weights = load_file(path / "adapter_model.safetensors")
    from safetensors.torch import save_file
    save_file({k: t * 2 for k, t in weights.items()}, path / "adapter_model.safetensors")
    again = compose_cfg("model=tiny_llama", f"model.adapter={path}", "run.progress=false", "run.until=download")
    assert next(s for s in build(again, recipe="adapter edited")["stages"])["key"] != download["key"]
