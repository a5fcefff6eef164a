"""quantize.source_grid on the real SmolLM2 file (its download only): the Q8_0 embedding carried exactly on every
backend, the Q4_1 linears only where the backend keeps a zero point (MLX), each carried weight equal to the float
weight transformers loaded, and the re-quantization cost reported per build."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.backends import BACKENDS
from pipeline.model.cache_modes import wrap
from pipeline.model.loading import load_hf_model
from pipeline.model.quant.apply import quantize_module
from pipeline.model.quant.source_grid import SourceGrid
from pipeline.stages.download import SOURCE_GGUF
from tests.helpers import compose_cfg

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def source(smollm2_model_dir):
    from pathlib import Path
    return SourceGrid(Path(smollm2_model_dir).parent / SOURCE_GGUF)


def _quantize(model_dir, source, backend, *overrides):
    cfg = compose_cfg("recipe=smollm2_custom", f"backend={backend}", *overrides)
    module = wrap(load_hf_model(model_dir), "static", 64, "last")
    floats = {n: m.weight.detach().clone() for n, m in module.model.named_modules()
              if isinstance(m, (nn.Linear, nn.Embedding))}
    with torch.no_grad():
        report = quantize_module(module, cfg.quantize, source, BACKENDS[backend].ASYMMETRIC_WEIGHTS)
    return module.model, floats, report


def test_xnnpack_carries_the_q8_0_embedding_and_requantizes_the_q4_1_linears(smollm2_model_dir, source):
    model, floats, report = _quantize(smollm2_model_dir, source, "xnnpack", "quantize.embedding=8w",
                                      "quantize.embedding_group_size=32", "quantize.source_grid=true")
    w = model.model.embed_tokens.weight
    assert torch.equal(w.dequantize(), floats["model.embed_tokens"])           # Q8_0: bit for bit
    assert report["weights"]["carried"] == 1 and report["weights"]["quantized"] == 212
    assert report["weights"]["requantized_rel_rms_mean"] > 0.05               # 8da4w on top of Q4_1


def test_mlx_carries_the_whole_grid(smollm2_model_dir, source):
    model, floats, report = _quantize(smollm2_model_dir, source, "mlx", "quantize=4w", "quantize.embedding=8w",
                                      "quantize.embedding_group_size=32", "quantize.lm_head=8w",
                                      "quantize.lm_head_group_size=32", "quantize.source_grid=true",
                                      "verify.native=false")
    # the 210 Q4_1 linears and the Q8_0 embedding, which the head shares again (the file ties them)
    assert report["retied"] and report["weights"]["carried"] == report["weights"]["quantized"] == 211
    assert report["weights"]["rel_rms_max"] < 1e-6
    q = model.model.layers[0].self_attn.q_proj.weight                           # llama.cpp's RoPE row order undone
    assert torch.allclose(q.dequantize(), floats["model.layers.0.self_attn.q_proj"], rtol=1e-5, atol=1e-6)


def test_without_the_knob_everything_is_requantized(smollm2_model_dir, source):
    _, _, report = _quantize(smollm2_model_dir, source, "mlx", "quantize=4w", "verify.native=false")
    assert report["weights"]["carried"] == 0 and report["weights"]["rel_rms_mean"] > 0.05
