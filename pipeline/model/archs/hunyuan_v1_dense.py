"""Hunyuan (dense): Llama's layout with per-head q/k norms (query_layernorm, key_layernorm, after the rotary). Its
checkpoints label their rotary "dynamic" with a fixed alpha, which HF's Hunyuan rotary computes once (a stretched
base): static, so it traces; "dynamic" without alpha would recompute per length."""
from pipeline.model.archs import Arch, Attention


def _length_dependent(params) -> bool:
    return isinstance(params, dict) and params.get("rope_type") == "dynamic" and not params.get("alpha")


ARCH = Arch(family="Hunyuan-Dense", attention=Attention(qk_norm="head"), static_ropes=("dynamic",),
            refuses=(("rope_parameters", _length_dependent,
                      "rope_type 'dynamic' without alpha recomputes its frequencies per length: not traceable"),))
