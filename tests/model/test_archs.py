"""The architecture registry (pipeline/model/archs) on a tiny random model of every entry, eagerly (seconds each): the
geometry names exactly the linears the model has, the wrapped module of every cache mode equals HF's own forward past
the sliding window, smoothing and projection fusing keep the float function, the experts run only their top-k, the
sinks' twin is HF's eager softmax, and a model_type outside the registry is refused before any work."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from pipeline import memory_estimate, preflight
from pipeline.config import v
from pipeline.support import readme_with_table
from pipeline.model import archs, sources
from pipeline.model.cache_modes import CACHE_MODES, wrap
from pipeline.model.layers.exportable import make_exportable
from pipeline.model.geometry import from_config
from pipeline.paths import ROOT
from pipeline.stages.wrap import compare, hf_reference
from tests.helpers import compose_cfg

OWN_CONF = {"gemma3_text": "tiny_gemma3", "gemma4_text": "tiny_gemma4"}
# config variants a family ships that its tiny model does not have: Llama 3.2's llama3 rope scaling
VARIANTS = {"llama3_rope": ("llama", {"rope_parameters": {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16}}),
    # Hunyuan's checkpoints: "dynamic" with a fixed alpha (a stretched base, computed once)
    "hunyuan_alpha_rope": ("hunyuan_v1_dense", {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}}),
    # ERNIE 4.5 MoE without shared experts
    "ernie4_5_moe_unshared": ("ernie4_5_moe", {"moe_num_shared_experts": 0}),
    # Falcon-H1 with the mixer's gated norm (its released models leave it off: y * silu(z))
    "falcon_h1_rms_norm": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}),
    # Granite-4.0-H as released: attention without rotary
    "granitemoehybrid_nope": ("granitemoehybrid", {"position_embedding_type": "nope"})}
TYPES = sorted(archs.ARCHS) + sorted(VARIANTS)


def tiny_overrides(model_type: str) -> list[str]:
    """The tiny random model of an entry: its own config group, or tiny_llama's dims (4 layers) with the entry."""
    if model_type in OWN_CONF:
        return [f"model={OWN_CONF[model_type]}"]
    return ["model=tiny_llama", f"model.random.arch={model_type}", "model.random.num_hidden_layers=4"]


def tiny_config(model_type: str):
    """The tiny model's HF config: an entry's, or a variant's (its entry's with the variant's fields)."""
    from transformers import AutoConfig
    base, extra = VARIANTS.get(model_type, (model_type, {}))
    d = dict(sources.random_hf_config(compose_cfg(*tiny_overrides(base)).model.random), **extra)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def tiny_model(model_type: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=archs.lookup(config.model_type).reference_attention)
    return model.eval()


def test_every_entry_is_a_declared_shape_named_by_its_model_type():
    from transformers import CONFIG_MAPPING
    for t, a in archs.ARCHS.items():
        assert isinstance(a, archs.Arch) and a.model_type == t and a.family
        assert t in CONFIG_MAPPING, f"{t}: not a model_type transformers knows"


@pytest.mark.parametrize("model_type", TYPES)
def test_geometry_names_every_linear_the_model_has(model_type):
    model = tiny_model(model_type)
    make_exportable(model)
    linears = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    g = from_config(model.config.get_text_config())
    assert linears == {n: (o, i) for n, (o, i, _) in g.linear_specs().items()}
    # the parameter count preflight estimates from, within the norms it counts roughly
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() < 2)
    assert abs(memory_estimate.parameter_count(g) - sum(p.numel() for p in model.parameters())) <= norms


@pytest.mark.parametrize("mode", sorted(CACHE_MODES))
@pytest.mark.parametrize("model_type", TYPES)
def test_every_mode_matches_hf_past_the_window(model_type, mode):
    """HF's own forward (experts and all, before the rewrites) against the wrapped module of each cache mode that
    builds the entry."""
    base = VARIANTS.get(model_type, (model_type,))[0]
    why = CACHE_MODES[mode].refuses_arch(archs.ARCHS[base], CACHE_MODES[mode].FLAGS[0])
    if why:
        pytest.skip(why)
    model = tiny_model(model_type)
    g = from_config(model.config.get_text_config())
    chunk = min(8, g.smallest_window or 8)
    with torch.no_grad():
        reference = hf_reference(model, 64, chunk, g.sliding_window, g.vocab_size)
        make_exportable(model)
        check = compare(wrap(model, mode, 64, "last", chunk), reference, chunk)
    assert check["max_abs_err"] < 1e-4 * max(check["logit_scale"], 10), (model_type, mode, check)
    if g.sliding_window:
        assert check["tokens"] > g.sliding_window  # the windows are exercised


@pytest.mark.parametrize("model_type", TYPES)
def test_smoothing_and_fusing_keep_the_float_function(model_type):
    from pipeline.model.layers.fused_projections import fuse_projections
    from pipeline.model.quant.smoothing import activation_maxima, smooth
    model = tiny_model(model_type)
    make_exportable(model)
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
        n = smooth(model, activation_maxima(model, [ids[0].tolist()]), 0.5)
        smoothed = model(ids, use_cache=False).logits
        fused = fuse_projections(model)
        after = model(ids, use_cache=False).logits
    assert n > 0, "nothing smoothed"
    scale = before.abs().max()
    assert (smoothed - before).abs().max() < 1e-4 * scale, model_type
    assert (after - smoothed).abs().max() < 1e-5 * scale, (model_type, fused)


@pytest.mark.parametrize("model_type", [t for t in sorted(archs.ARCHS) if archs.ARCHS[t].experts is not None])
def test_a_token_runs_only_its_top_k_experts(model_type):
    from pipeline.model.layers.experts import ExpertBank, PackedExperts
    model = tiny_model(model_type)
    make_exportable(model)
    bank = next(m for m in model.modules() if isinstance(m, ExpertBank))
    ran = []
    hooks = [x.register_forward_pre_hook(lambda m, args, e=e: ran.append((e, args[0].shape[0])))
             for e, x in enumerate(bank)]
    hidden = torch.randn(1, model.config.hidden_size)
    idx, w = torch.tensor([[5, 2]]), torch.tensor([[0.7, 0.3]])
    with torch.no_grad():
        out = bank(hidden, idx, w)
        for h in hooks:
            h.remove()
        assert sorted(ran) == [(2, 1), (5, 1)]
        # the exported form's twin (the llmpipe::experts op in eager) computes the same
        packed = PackedExperts(bank)(hidden, idx, w)
    assert torch.allclose(out, packed, atol=1e-6)


def test_sinks_twin_is_hf_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from pipeline.model.layers.attention import attend_gathered
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16,
                                                                                                         generator=g)
    module = nn.Module()
    module.num_key_value_groups, module.training, module.sinks = 2, False, torch.randn(4, generator=g)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    got = attend_gathered(q, k[0], v[0], 0, 0, 0, 0.25, torch.float32, module.sinks)
    assert torch.allclose(got.transpose(1, 2), ref, atol=1e-6)


def test_role_overrides_name_each_architectures_linears():
    """The default's `role: down` takes the MLP's and every expert's down projection; `k` or `v` takes a fused qkv
    (the default's k and v overrides fit phi3); a role the architecture does not have is refused with its roles."""
    from pipeline.model.quant.resolve import override_matches
    g = from_config(tiny_config("qwen3_moe"))
    downs = [n for n, (_, _, r) in g.linear_specs().items() if r == "down"]
    assert len(downs) == 4 * 8 and all(n.endswith("experts.%s.down_proj" % n.split(".")[-2]) for n in downs)
    phi3 = from_config(tiny_config("phi3")).linear_specs()
    v_role = compose_cfg(*tiny_overrides("phi3"), "quantize=8da4w_gptq").quantize.overrides[1]
    assert v(v_role.role) == "v"
    assert {r for n, (_, _, r) in phi3.items() if override_matches(v_role, n, r)} == {"qkv"}
    assert preflight.check(compose_cfg(*tiny_overrides("phi3"), "quantize=8da4w_gptq")) is not None
    cfg = compose_cfg(*tiny_overrides("phi3"), "+quantize.overrides=[{role: delta_z, scheme: 8da8w, group_size: 0}]")
    with pytest.raises(Exception, match=r"has no linear of that role; its roles: \[.*'qkv'"):
        preflight.check(cfg)


@pytest.mark.parametrize("config", [{"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2},
                                    {"model_type": "rwkv", "hidden_size": 64, "num_hidden_layers": 2}],
                         ids=["mamba", "rwkv"])
def test_a_model_type_outside_the_registry_is_refused_before_any_work(tmp_path, config):
    """From config.json alone: exit 2, the model_type and the supported list, no traceback, nothing built."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = subprocess.run([sys.executable, "-m", "pipeline", "model=hf", "model.source=local",
                        f"model.path={tmp_path}", "model.name=outside"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"model_type {config['model_type']!r} is not supported" in out and "'phi3'" in out and "'gpt_oss'" in out
    assert "Traceback" not in out and "stage=" not in out


def test_the_readme_table_is_the_registry_s():
    readme = (ROOT / "README.md").read_text()
    assert readme_with_table(readme) == readme, "run: python -m pipeline support --write-readme"


def test_what_an_entry_cannot_build_is_named_from_the_config():
    """Hunyuan's rotary: 'dynamic' with a fixed alpha is static (built), without alpha it recomputes per length; its
    MoE's per-layer expert counts."""
    dense, moe = archs.ARCHS["hunyuan_v1_dense"], archs.ARCHS["hunyuan_v1_moe"]
    assert dense.problems(tiny_config("hunyuan_alpha_rope")) == []
    no_alpha = tiny_config("hunyuan_v1_dense")
    no_alpha.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert [k for k, _, _ in dense.problems(no_alpha)] == ["rope_parameters"]
    config = tiny_config("hunyuan_v1_moe")
    config.moe_topk = [2, 2, 2, 2]
    assert [(k, why) for k, _, why in moe.problems(config)] == [
        ("moe_topk", "a value per layer: allowed one int for every layer")]
