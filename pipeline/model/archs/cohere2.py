"""Cohere 2 (Command R7B): a parallel block (attention and MLP read one LayerNorm's output and add to the residual
together), sliding and full layers, logits scaled by logit_scale."""
from pipeline.model.archs import Arch, Norms

ARCH = Arch(family="Cohere 2",
            norms=Norms(placement="parallel", mlp_input="input_layernorm", kind="layer"),
            rotary="rope on sliding layers; NoPE on full layers", logits="logit_scale", tiny={"sliding_window": 24})
