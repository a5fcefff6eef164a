"""Loading an HF causal LM from a model folder, as every stage that needs the eager model does."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from pipeline.abi import DTYPES


def load_hf_model(model_dir: Path, dtype: str = "fp32") -> nn.Module:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
    model.eval()
    for m in model.modules():
        # an embedding with padding_idx lowers to an op without an out variant once quantized
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    return model
