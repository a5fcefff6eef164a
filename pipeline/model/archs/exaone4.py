"""EXAONE 4.0: post-norm with per-head q/k norms; hybrid models alternate sliding layers (rotary) and full layers
(no rotary: NoPE)."""
from pipeline.model.archs import Arch, Attention, Norms

ARCH = Arch(family="EXAONE-4", attention=Attention(qk_norm="head"),
            norms=Norms(placement="post", attention_input=None, mlp_input=None),
            rotary="rope on sliding layers; NoPE on full layers",
            tiny={"sliding_window": 24, "sliding_window_pattern": 4})
