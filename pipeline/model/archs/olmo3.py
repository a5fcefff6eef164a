"""OLMo-3: OLMo-2's post-norm layout with sliding and full layers."""
from pipeline.model.archs import Arch, Attention, Norms

ARCH = Arch(family="OLMo-3", attention=Attention(qk_norm="projection"),
            norms=Norms(placement="post", attention_input=None, mlp_input=None), tiny={"sliding_window": 24})
