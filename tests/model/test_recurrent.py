"""Recurrent layers (pipeline/model/layers/recurrent.py) on tiny Qwen3.5, Qwen3-Next, LFM2, Bamba, Granite-4.0-H,
Falcon-H1 and Nemotron-H models: each cache mode's wrapper against HF's own uncached forward, every row of a prompt
several chunks long, at chunks of 1, 7 and the default's; a step at 0 starts over; the HF model called alone leaves
the state as it was; a step back is refused; the program's published layer kinds; what preflight refuses; Qwen3-Next's
fused projections split at load, and its shared expert's gate kept float."""
from __future__ import annotations

import pytest
import torch

from pipeline import preflight
from pipeline.model.layers import recurrent
from pipeline.model.cache_modes import wrap
from pipeline.model.layers.exportable import make_exportable
from tests.helpers import compose_cfg
from tests.model.test_archs import tiny_model, tiny_overrides

HYBRIDS = ["qwen3_5_text", "qwen3_next", "lfm2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h"]
N = 300


@pytest.fixture(scope="module", params=[(t, m) for t in HYBRIDS for m in ("custom", "static", "offgraph")],
                ids=lambda p: "-".join(p))
def hybrid(request):
    """(model_type, the wrapped module of a cache mode, ids, HF's logits for every row)."""
    model_type, mode = request.param
    model = tiny_model(model_type)
    ids = torch.randint(3, 500, (1, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits[0]
    make_exportable(model)
    return model_type, wrap(model, mode, 512, "full", 128), ids, want


def run(module, ids: torch.Tensor, piece: int, start: int = 0) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for p in range(0, ids.shape[1], piece):
            e = min(ids.shape[1], p + piece)
            rows.append(module(ids[:, p:e], torch.arange(start + p, start + e))[0])
    return torch.cat(rows)


@pytest.mark.parametrize("piece", [1, 7, 128])
def test_every_row_equals_hf_in_chunks(hybrid, piece):
    model_type, module, ids, want = hybrid
    got = run(module, ids, piece)
    assert (got - want).abs().max().item() < 1e-4 * max(want.abs().max().item(), 10), (model_type, piece)
    assert got[-20:].argmax(-1).tolist() == want[-20:].argmax(-1).tolist()


def states(module) -> list[torch.Tensor]:
    """The recurrent state wherever the mode keeps it: the mixers' buffers, or the runtime cache's."""
    cache = getattr(module, "cache", None)
    if hasattr(cache, "states"):
        return [t for s in cache.states for t in s.values()]
    return [b for m in recurrent.mixers(module) for b in m.buffers(recurse=False)]


def test_a_step_at_zero_starts_over_and_the_hf_model_alone_leaves_the_state(hybrid):
    model_type, module, ids, want = hybrid
    run(module, ids.flip(1), 32)  # another sequence first: its state must not leak
    held = [s.clone() for s in states(module)]
    assert held and all(s.abs().sum() > 0 for s in held)
    with torch.no_grad():
        alone = module.model(ids, use_cache=False).logits[0]
    assert all(torch.equal(a, b) for a, b in zip(held, states(module)))
    assert (alone - want).abs().max().item() < 1e-4 * max(want.abs().max().item(), 10)
    got = run(module, ids, 64)
    assert (got - want).abs().max().item() < 1e-4 * max(want.abs().max().item(), 10)


def test_the_runtime_s_state_cannot_step_back():
    model = tiny_model("lfm2")
    make_exportable(model)
    module = wrap(model, "offgraph", 64, "last", 8)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(2))
    run(module, ids, 8)
    with pytest.raises(Exception, match="recurrent state holds position 12 only"):
        module(ids[:, :2], torch.arange(4, 6))
    assert "4 layers: 2 conv(2x64) + 2 flat" in module.cache.describe()


def test_the_program_publishes_each_layer_s_kind_and_state():
    model = tiny_model("qwen3_5_text")
    methods = recurrent.state_methods(model.config.get_text_config(), rings=True)
    assert methods["get_layer_kinds"].tolist() == [2, 2, 2, 0]  # three Gated DeltaNet layers, then full attention
    assert methods["get_state_shapes"].tolist() == [4, 16, 16, 3, 128] * 3  # heads x key x value dims; conv rows x C
    lfm = tiny_model("lfm2")
    methods = recurrent.state_methods(lfm.config.get_text_config(), rings=True)
    assert methods["get_layer_kinds"].tolist() == [3, 0, 3, 0]
    assert methods["get_state_shapes"].tolist() == [0, 0, 0, 2, 64] * 2
    # Mamba-2: heads x state size x head dim; conv rows x (x, B and C channels); Falcon-H1's beside attention
    # (Nemotron-H: Mamba-2, MLP, attention, MLP blocks)
    for model_type, kinds in (("bamba", [4, 0, 4, 0]), ("falcon_h1", [5] * 4), ("nemotron_h", [4, 6, 0, 6])):
        methods = recurrent.state_methods(tiny_model(model_type).config, rings=True)
        assert methods["get_layer_kinds"].tolist() == kinds
        assert methods["get_state_shapes"].tolist() == [8, 16, 16, 3, 128 + 2 * 2 * 16] * kinds.count(kinds[0])
    assert recurrent.state_methods(tiny_model("qwen3").config, rings=True) == {}


@pytest.mark.parametrize("override,match", [
    ("cache.custom_kv_cache=false", "kept beside the fused op"),
    ("export.dtype=bf16", "recurrent layers' kernels .* take fp32 activations"),
])
def test_what_does_not_build_them_yet_is_refused_at_preflight(override, match):
    cfg = compose_cfg(*tiny_overrides("qwen3_5_text"), override)
    with pytest.raises(Exception, match=match):
        preflight.check(cfg)


def test_qwen3_next_s_fused_projections_split_without_moving_the_logits():
    """The fused in_proj_qkvz / in_proj_ba, grouped per key head, become Qwen3.5's four projections: HF's forward
    gives the same logits before and after (the expert banks' rewrite too: float sums in another order)."""
    model = tiny_model("qwen3_next")
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    done = make_exportable(model)
    with torch.no_grad():
        after = model(ids).logits
    assert done["delta_projections_split"] == 3 and done["experts_rewritten"] == 3
    assert (after - before).abs().max() < 1e-5 * before.abs().max()
    layer = model.model.layers[0].linear_attn
    assert not hasattr(layer, "in_proj_qkvz") and layer.in_proj_qkv.weight.shape == (2 * 2 * 16 + 4 * 16, 64)


def test_the_shared_experts_gate_stays_float_unless_an_override_names_it():
    from pipeline.model.quant.apply import linear_plan
    model = tiny_model("qwen3_next")
    make_exportable(model)
    gates = {f"model.layers.{i}.mlp.shared_expert_gate" for i in (0, 2, 3)}  # layer 1 is dense

    def planned(*overrides):
        q = compose_cfg(*tiny_overrides("qwen3_next"), "quantize=8da4w", *overrides).quantize
        return {n for names in linear_plan(model, q, retie=False).values() for n in names}
    default = planned()
    assert not gates & default and "model.layers.0.mlp.shared_expert.down_proj" in default
    assert gates <= planned("+quantize.overrides=[{role: shared_gate, scheme: 8w, group_size: 0}]")
