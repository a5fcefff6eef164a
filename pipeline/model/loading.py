"""Loading an HF causal LM from a model folder, as every stage that needs the eager model does."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from pipeline.abi import DTYPES
from pipeline.model import archs


def load_hf_model(model_dir: Path, dtype: str = "fp32") -> nn.Module:
    """The model with HF's own modules and its entry's reference attention (sdpa, or eager where HF has no sdpa
    path); pipeline/model/layers/exportable.py's make_exportable adds the rewrites that make it export."""
    from transformers import AutoConfig, AutoModelForCausalLM
    arch = archs.lookup(AutoConfig.from_pretrained(model_dir).get_text_config().model_type)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype],
                                                 attn_implementation=arch.reference_attention)
    model.eval()
    for m in model.modules():
        # an embedding with padding_idx lowers to an op without an out variant once quantized
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    return model
