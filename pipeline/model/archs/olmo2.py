"""OLMo-2: post-norm (the norms follow attention and the MLP; the projections read the residual stream) with q/k norms
over the whole projection."""
from pipeline.model.archs import Arch, Attention, Norms

ARCH = Arch(family="OLMo-2", attention=Attention(qk_norm="projection"),
            norms=Norms(placement="post", attention_input=None, mlp_input=None))
