"""The model architectures, one module each; the file name is the HF `model_type` (config.json's, or its
`text_config`'s for a multimodal checkpoint).

Each module holds `ARCH = Arch(...)`: the declared shape of its decoder, written as what differs from the plain
(Llama) decoder. Geometry, wrap, quantize, smoothing, projection fusing, preflight and verify ask the entry; none of
them names a module. A `model_type` outside this registry is refused at preflight, from config.json alone.

HF's own modeling code runs the forward (rotary variants, multipliers, softcaps, norms), so an entry declares where
things are and what they are, not how to compute them; what HF computes in a way that does not export is rewritten
after wrap's reference (pipeline/model/layers/exportable.py: the experts of a mixture-of-experts layer, longrope's
switch).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from pipeline.errors import PipelineError

# the layer kinds an attention cache mode builds
ATTENTION_KINDS = ("full_attention", "sliding_attention")
# the layer kinds whose state is a fixed-size recurrent one (an entry declares which it has); any other is refused
RECURRENT_KINDS = ("linear_attention", "conv", "mamba")
# attention and a Mamba-2 mixer side by side in one layer (Falcon-H1): a K/V cache and a recurrent state
PARALLEL_KINDS = ("hybrid",)
# the layer kinds with a recurrent state
STATE_KINDS = RECURRENT_KINDS + PARALLEL_KINDS
# a layer that is an MLP block alone, no token mixer (Nemotron-H's `mlp` and `moe` blocks): no K/V, no state
MLP_KINDS = ("mlp", "moe")
# the names of one expert's linears after the rewrite (model/layers/experts.py builds them, geometry lists them)
EXPERT_LINEARS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# expert activations that read up alone: the expert has no gate
UNGATED_ACTIVATIONS = ("relu2",)
# what a linear is in its layer (quantize.overrides[].role), whatever the architecture names it
ROLES = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "per_layer", "lm_head",
         "delta_qkv", "delta_z", "delta_gates", "delta_out", "conv_in", "conv_out", "shared_gate",
         "router", "ssm_in", "ssm_out")
# the roles a fused linear holds: an override naming one of them takes the fused linear too (`v` at 8 bits puts a
# fused qkv at 8 bits, as llama.cpp's Q4_K_M treats attn_qkv as attn_v), so a recipe's roles fit either layout
FUSED_ROLES = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
# roles kept in float unless an override names them: a shared expert's gate is one output row (a scalar per token that
# scales the whole shared expert), where a 4-bit step would be all of its error; a router held as a linear (HunYuan's)
# picks the experts, where a rounding flips a near-tie
FLOAT_ROLES = ("shared_gate", "router")
# rotary scalings that trace to a program: `dynamic` recomputes its frequencies in a Python branch on the length
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


class UnsupportedArch(PipelineError):
    """A model_type (or GGUF architecture) outside the registry: `name` it, `why` not, with the supported list."""
    exit_code = 2

    def __init__(self, key: str, name, why: str):
        super().__init__(f"{key}={name!r}: {why}")
        self.key, self.name, self.why = key, name, why


def _config_layer_kinds(config) -> list[str]:
    """Each layer's attention kind: the config's layer_types, else every layer sliding where the config sets a
    window (Mistral, Phi-3, Mixtral: HF's mask is then sliding in every layer), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    window = getattr(config, "sliding_window", None)
    return ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers


@dataclass(frozen=True)
class Attention:
    path: str = "self_attn"            # in a decoder layer
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: Optional[str] = None          # one fused linear, rows q then k then v (Phi-3)
    qk_norm: str = ""                  # "" | "head" (per head, Qwen3) | "projection" (over the projection, OLMo-2)
    v_norm: bool = False               # values RMS-normalized (Gemma 4): o_proj's input cannot be smoothed through v
    sinks: Optional[str] = None        # a per-head sink logit parameter (gpt-oss): softmax over the keys and the sink
    head_dim_key: Optional[str] = "head_dim"   # None: hidden_size // heads whatever the config says (Phi-3)
    output_gate: bool = False          # q's projection also holds a per-head gate on the output (Qwen3.5): 2x rows


@dataclass(frozen=True)
class Mlp:
    path: str = "mlp"                  # in a decoder layer
    gate: Optional[str] = "gate_proj"  # None: down reads act(up(x)) (Arcee's ReLU^2, Apertus' xIELU)
    up: str = "up_proj"
    down: str = "down_proj"
    gate_up: Optional[str] = None      # one fused linear, gate rows then up rows (Phi-3, GLM-4)
    width_key: str = "intermediate_size"
    width: Optional[Callable] = None   # config -> the MLP's width, where it is derived from width_key (LFM2)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP block: a router (kept in float) and a bank of experts, of which a token runs top-k."""
    # in the MLP block: the module that returns (logits, top-k weights, top-k index) and holds the router's weight
    router: str = "gate"
    router_linear: str = ""            # the weight's nn.Linear in the router (HunYuan's wg): listed with the linears
    bank: str = "experts"              # in the MLP block: the experts' stacked weights (rewritten to linears)
    count_key: str = "num_experts"
    top_k_key: str = "num_experts_per_tok"
    width_key: str = "moe_intermediate_size"
    # "stacked": gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I], no biases (Qwen3-MoE, Mixtral);
    # "interleaved": gate_up [E, H, 2I] with gate/up alternating columns, down [E, I, H], biases (gpt-oss);
    # "ungated": up [E, I, H] and down [E, H, I], no gate (Nemotron-H)
    layout: str = "stacked"
    # "silu": act(gate) * up; "clamped_swiglu": gpt-oss's, limit and alpha; "relu2": relu(up)^2, ungated
    activation: str = "silu"
    # layers whose MLP is dense, from the config (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)
    dense_layers: Callable = field(default=lambda config: [])
    # a shared expert every token runs beside the routed ones (an MLP in the block, with the entry's Mlp names),
    # scaled by sigmoid(shared_gate(x)) (Qwen3-Next) or not at all (shared_gate "": ERNIE 4.5); "" = none
    shared: str = ""
    shared_gate: str = ""
    shared_width_key: str = "shared_expert_intermediate_size"
    shared_width: Optional[Callable] = None   # config -> the shared expert's width, where derived (ERNIE 4.5)
    # the shared expert sits beside the block in the decoder layer (Granite-4.0-H's shared_mlp, which the layer's own
    # forward adds), not inside it
    shared_in_layer: bool = False


@dataclass(frozen=True)
class GatedDeltaNet:
    """A `linear_attention` layer (Qwen3.5): q|k|v through a short causal conv, then the gated delta rule over a
    [value heads, key dim, value dim] state (pipeline/model/layers/recurrent.py); a gated norm and out_proj."""
    path: str = "linear_attn"          # in a decoder layer
    qkv: str = "in_proj_qkv"           # rows q, k, v: the conv's channels
    z: str = "in_proj_z"               # the output gate
    b: str = "in_proj_b"               # the write strength (beta = sigmoid(b))
    a: str = "in_proj_a"               # the decay's input
    out: str = "out_proj"
    conv: str = "conv1d"               # depthwise Conv1d over the q|k|v channels
    norm: str = "norm"                 # gated RMSNorm over each head's output
    key_heads_key: str = "linear_num_key_heads"
    value_heads_key: str = "linear_num_value_heads"
    key_dim_key: str = "linear_key_head_dim"
    value_dim_key: str = "linear_value_head_dim"
    kernel_key: str = "linear_conv_kernel_dim"
    # Qwen3-Next: q|k|v|z and b|a come fused, grouped per key head; load splits them into the four above
    # (exportable.split_delta_projections), so "" everywhere but in the HF checkpoint's layout
    fused_qkvz: str = ""
    fused_ba: str = ""


@dataclass(frozen=True)
class ShortConv:
    """A `conv` layer (LFM2): in_proj to B|C|x, y = C * conv(B * x) over a depthwise causal conv, out_proj."""
    path: str = "conv"                 # in a decoder layer
    in_proj: str = "in_proj"
    out: str = "out_proj"
    conv: str = "conv"
    kernel_key: str = "conv_L_cache"


@dataclass(frozen=True)
class Mamba2:
    """A `mamba` layer (Bamba, Granite-4.0-H, Nemotron-H; Falcon-H1's beside attention: `hybrid`): in_proj to
    z | x,B,C | dt, x,B,C through a depthwise causal conv (silu), Mamba-2's SSD scan over a [heads, state size,
    head dim] state (pipeline/model/layers/ssd.py), a gated RMSNorm of y with z, out_proj. HF 5.x names these layers
    `linear_attention`: the entry's layer_kinds maps them."""
    path: str = "mamba"                # in a decoder layer
    in_proj: str = "in_proj"
    conv: str = "conv1d"
    norm: str = "norm"
    out: str = "out_proj"
    heads_key: str = "mamba_n_heads"
    head_dim_key: str = "mamba_d_head"
    groups_key: str = "mamba_n_groups"
    state_key: str = "mamba_d_state"
    kernel_key: str = "mamba_d_conv"
    activation_key: str = "hidden_act"  # the conv's activation: silu is what the op runs
    parallel: bool = False             # beside the attention in every layer (Falcon-H1's `hybrid` layers)


def expert_linears(activation: str) -> dict[str, str]:
    """The linears of one expert under an activation (an ungated one has no gate)."""
    return {r: n for r, n in EXPERT_LINEARS.items() if r != "gate" or activation not in UNGATED_ACTIVATIONS}


def mamba_layer_kinds(config) -> list[str]:
    """HF's layer types with its `linear_attention` (a Mamba-2 mixer in these families) named `mamba`; a checkpoint's
    own names ("mamba", "attention": Granite-4.0-H's config.json) read as HF reads them."""
    names = {"linear_attention": "mamba", "attention": "full_attention"}
    return [names.get(t, t) for t in _config_layer_kinds(config)]


@dataclass(frozen=True)
class Norms:
    placement: str = "pre"             # pre | post | sandwich | parallel: where the layer's norms sit
    attention_input: Optional[str] = "input_layernorm"         # the norm the attention projections read (None:
    mlp_input: Optional[str] = "post_attention_layernorm"      # they read the residual: post-norm); likewise the MLP
    offset: float = 0.0                # norms scale by (offset + weight): Gemma's 1
    kind: str = "rms"                  # rms | layer (Cohere's LayerNorm without bias)


@dataclass(frozen=True)
class PerLayer:
    """Gemma 4's per-layer geometry (the config's keys): KV-shared trailing layers, values = keys on global layers,
    per-layer input embeddings, double-wide MLPs on shared layers. Each layer's head dim and KV heads come from the
    config's per_layer_config (global layers' own)."""
    k_eq_v_key: str = "attention_k_eq_v"
    kv_shared_key: str = "num_kv_shared_layers"
    input_width_key: str = "hidden_size_per_layer_input"
    double_wide_key: str = "use_double_wide_mlp"


@dataclass(frozen=True)
class Arch:
    family: str                        # what users call it
    attention: Attention = Attention()
    mlp: Mlp = Mlp()
    experts: Optional[Experts] = None
    norms: Norms = Norms()
    per_layer: Optional[PerLayer] = None
    gated_delta: Optional[GatedDeltaNet] = None    # the model's `linear_attention` layers
    short_conv: Optional[ShortConv] = None         # the model's `conv` layers
    mamba2: Optional[Mamba2] = None                # the model's `mamba` layers
    layers: str = "model.layers"       # the decoder layers, in the causal LM
    layer_kinds: Callable = field(default=_config_layer_kinds)
    # each layer is one block behind one norm: a token mixer (attention, Mamba-2) or an MLP (MLP_KINDS), at the same
    # path (Nemotron-H's `mixer`)
    blocks: bool = False
    # what HF's forward applies and the entry only records (the support table; preflight's refusals)
    rotary: str = "rope"               # e.g. "rope, partial", "rope; NoPE layers"
    embedding_scale: str = ""          # e.g. "sqrt(hidden)" (Gemma), "embedding_multiplier" (Granite)
    logits: str = ""                   # e.g. "final softcap" (Gemma), "logit_scale" (Cohere 2)
    # the float reference's attention implementation (HF's sdpa, or eager where the model has no sdpa path)
    reference_attention: str = "sdpa"
    # config features the pipeline does not build: (key, predicate on its value, why)
    refuses: tuple = ()
    # rope types beside ROPE_TYPES that this family's own rotary computes once (Hunyuan's "dynamic" with a fixed
    # alpha); what it cannot is in `refuses`
    static_ropes: tuple = ()
    # the config fields of a tiny random model beside the common dims (tests; model.source=random), or a function
    # (model.random, common dims) -> its config dict where the fields depend on the dims
    tiny: dict = field(default_factory=dict)
    random_config: Optional[Callable] = None
    gguf_arch: Optional[str] = None    # a GGUF file's general.architecture naming this model_type
    # the layer types a GGUF file of this family implies, from its layer count and sliding window (None: all full)
    gguf_layer_types: Optional[Callable] = None
    tiny_model: str = "tiny_llama"     # the conf/model option `validate --smoke` starts from (model.random.arch set)
    model_type: str = ""               # set from the file name

    # --- where things are, in a loaded model ---------------------------------------------------------------------
    def decoder_layers(self, model) -> list:
        return list(model.get_submodule(self.layers))

    def attention_module(self, layer):
        return layer.get_submodule(self.attention.path)

    def attention_layers(self, model) -> list[tuple[int, object]]:
        """(index, decoder layer) of every layer whose token mixer is attention (not a recurrent layer, not an MLP
        block alone)."""
        kinds = self.layer_kinds(model.config.get_text_config())
        return [(i, layer) for i, (layer, kind) in enumerate(zip(self.decoder_layers(model), kinds))
                if kind not in RECURRENT_KINDS + MLP_KINDS]

    def has_mlp(self, kind: str) -> bool:
        """Does a layer of this kind hold an MLP block (every layer, but a block model's mixer layers)?"""
        return not self.blocks or kind in MLP_KINDS

    def recurrent_kinds(self) -> tuple[str, ...]:
        """The layer kinds with a recurrent state this entry declares (archs.STATE_KINDS)."""
        mamba = (("hybrid",) if self.mamba2.parallel else ("mamba",)) if self.mamba2 else ()
        return (("linear_attention",) if self.gated_delta else ()) + (("conv",) if self.short_conv else ()) + mamba

    def mixer_path(self, kind: str) -> str:
        """Where a layer of this kind keeps its token mixer: the attention, or a recurrent layer's block (a `hybrid`
        layer's recurrent one)."""
        return {"linear_attention": self.gated_delta.path if self.gated_delta else None,
                "conv": self.short_conv.path if self.short_conv else None,
                "mamba": self.mamba2.path if self.mamba2 else None,
                "hybrid": self.mamba2.path if self.mamba2 else None}.get(kind, self.attention.path)

    def mlp_module(self, layer):
        return layer.get_submodule(self.mlp.path)

    def shared_expert(self, layer):
        """The layer's shared expert (an MLP with the entry's Mlp names), or None."""
        x = self.experts
        if x is None or not x.shared or not self.has_experts(layer):
            return None
        return getattr(layer if x.shared_in_layer else self.mlp_module(layer), x.shared, None)

    def has_experts(self, layer) -> bool:
        """Is this layer's MLP a mixture of experts (HF's bank, or ours after the rewrite)?"""
        return self.experts is not None and hasattr(self.mlp_module(layer), self.experts.bank)

    # --- what the config says ------------------------------------------------------------------------------------
    def head_dim(self, config) -> int:
        key = self.attention.head_dim_key
        return (getattr(config, key, None) if key else None) or config.hidden_size // config.num_attention_heads

    def problems(self, config) -> list[tuple[str, object, str]]:
        """(config key, value, why) of every feature of this config the pipeline cannot build."""
        out = [(key, getattr(config, key, None), why) for key, bad, why in self.refuses
               if bad(getattr(config, key, None))]
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        if self.experts is not None and self.experts.activation == "silu" and act not in (None, "silu"):
            out.append(("hidden_act", act, "the experts' kernel runs silu(gate) * up: allowed ['silu']"))
        if self.mamba2 is not None and getattr(config, self.mamba2.activation_key, "silu") != "silu":
            out.append((self.mamba2.activation_key, getattr(config, self.mamba2.activation_key),
                        "the Mamba-2 conv runs silu: allowed ['silu']"))
        known = ATTENTION_KINDS + self.recurrent_kinds() + (MLP_KINDS if self.blocks else ())
        kinds = sorted(set(self.layer_kinds(config)) - set(known))
        if kinds:
            out.append(("layer_types", kinds, f"layer kinds the {self.family} entry builds: {list(known)}"))
        for rope in _rope_types(config):
            if rope not in ROPE_TYPES + self.static_ropes:
                out.append(("rope_parameters.rope_type", rope,
                            f"not traceable to a program; allowed: {list(ROPE_TYPES)}"))
        return out


def _rope_types(config) -> set[str]:
    """The rope_type values of a config (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" in params or "rope_theta" in params:
        params = {"all": params}
    return {p.get("rope_type", "default") for p in params.values() if isinstance(p, dict)}


def _load() -> dict[str, Arch]:
    entries = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if not isinstance(getattr(module, "ARCH", None), Arch):
            raise TypeError(f"{module.__name__} must define ARCH = Arch(...)")
        entries[info.name] = replace(module.ARCH, model_type=info.name)
    return entries


ARCHS: dict[str, Arch] = _load()


def lookup(model_type: Optional[str]) -> Arch:
    """The entry of an HF model_type; refused with the supported list otherwise."""
    if model_type in ARCHS:
        return ARCHS[model_type]
    raise UnsupportedArch("config.json model_type", model_type, f"model_type {model_type!r} is not supported by this "
                          f"pipeline (no pipeline/model/archs/{model_type}.py). Supported: {sorted(ARCHS)}")


def for_gguf(general_arch: str) -> Arch:
    """The entry a GGUF file's general.architecture names."""
    for arch in ARCHS.values():
        if (arch.gguf_arch or arch.model_type) == general_arch:
            return arch
    supported = sorted(a.gguf_arch or a.model_type for a in ARCHS.values())
    raise UnsupportedArch("GGUF general.architecture", general_arch, f"GGUF architecture {general_arch!r} is not "
                          f"supported by this pipeline. Supported: {supported}")


def of_model(model) -> Arch:
    """The entry of a loaded HF causal LM."""
    return of_model_config(model.config)


def of_model_config(config) -> Arch:
    """The entry of an HF config object (a multimodal one: its text part's)."""
    return lookup(config.get_text_config().model_type)
