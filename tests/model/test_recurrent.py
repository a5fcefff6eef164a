"""Recurrent layers (pipeline/model/recurrent.py) on tiny Qwen3.5 and LFM2 models: the custom cache mode's wrapper
against HF's own uncached forward, every row of a prompt several chunks long, at chunks of 1, 7 and the default's;
a step at 0 starts over; the HF model called alone leaves the state as it was; the program's published layer kinds;
what preflight refuses."""
from __future__ import annotations

import pytest
import torch

from pipeline import preflight
from pipeline.model import recurrent
from pipeline.model.cache_modes import wrap
from pipeline.model.exportable import make_exportable
from tests.helpers import compose_cfg
from tests.model.test_archs import tiny_model, tiny_overrides

HYBRIDS = ["qwen3_5_text", "lfm2"]
N = 300


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    """(model_type, the wrapped custom-mode module, ids, HF's logits for every row)."""
    model = tiny_model(request.param)
    ids = torch.randint(3, 500, (1, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits[0]
    make_exportable(model)
    return request.param, wrap(model, "custom", 512, "full", 128), ids, want


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


def test_a_step_at_zero_starts_over_and_the_hf_model_alone_leaves_the_state(hybrid):
    model_type, module, ids, want = hybrid
    run(module, ids.flip(1), 32)  # another sequence first: its state must not leak
    states = [b.clone() for m in recurrent.mixers(module) for b in m.buffers(recurse=False)]
    assert any(s.abs().sum() > 0 for s in states)
    with torch.no_grad():
        alone = module.model(ids, use_cache=False).logits[0]
    assert all(torch.equal(a, b) for a, b in zip(states, [b for m in recurrent.mixers(module)
                                                          for b in m.buffers(recurse=False)]))
    assert (alone - want).abs().max().item() < 1e-4 * max(want.abs().max().item(), 10)
    got = run(module, ids, 64)
    assert (got - want).abs().max().item() < 1e-4 * max(want.abs().max().item(), 10)
    assert module.cache_bytes() > sum(s.numel() * s.element_size() for s in states) > 0


def test_the_program_publishes_each_layer_s_kind_and_state():
    model = tiny_model("qwen3_5_text")
    methods = recurrent.state_methods(model.config.get_text_config(), rings=True)
    assert methods["get_layer_kinds"].tolist() == [2, 2, 2, 0]  # three Gated DeltaNet layers, then full attention
    assert methods["get_state_shapes"].tolist() == [4, 16, 16, 3, 128] * 3  # heads x key x value dims; conv rows x C
    lfm = tiny_model("lfm2")
    methods = recurrent.state_methods(lfm.config.get_text_config(), rings=True)
    assert methods["get_layer_kinds"].tolist() == [3, 0, 3, 0]
    assert methods["get_state_shapes"].tolist() == [0, 0, 0, 2, 64] * 2
    assert recurrent.state_methods(tiny_model("qwen3").config, rings=True) == {}


@pytest.mark.parametrize("override,match", [
    ("cache=offgraph", "off-graph runtime does not own their state yet"),
    ("backend=mlx", "MLX programs do not build their state"),
    ("cache.custom_kv_cache=false", "kept beside the fused op"),
])
def test_what_does_not_build_them_yet_is_refused_at_preflight(override, match):
    cfg = compose_cfg(*tiny_overrides("qwen3_5_text"), override)
    with pytest.raises(Exception, match=match):
        preflight.check(cfg)
