"""Config schema: one dataclass per Hydra config group, registered in the ConfigStore.

This module is the single source of truth for every knob. Closed choices are str Enums so that
Hydra rejects unknown values at composition time with the list of allowed ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipeline.model.archs import ARCHS, ROLES
from pipeline.registry import v  # noqa: F401  (config.v: the plain value of a field, for the layers above)


class Source(str, Enum):
    hf = "hf"          # huggingface_hub snapshot, revision pinned to a commit
    local = "local"    # a folder in HF layout
    gguf = "gguf"      # a GGUF file, or one shipped inside an installed Python package
    random = "random"  # a tiny randomly initialised model built from a config (tests)


class AdapterMode(str, Enum):
    """What becomes of a PEFT LoRA adapter (model.adapter)."""
    merge = "merge"        # folded into the weights at download, before quantization: one plain program
    # kept apart: the base model quantized and lowered once, its weights in foundation.ptd; the adapter's branches
    # stay in the program (fp32 low-rank linears beside each base linear), so adapters share one foundation file
    separate = "separate"


class DType(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class KvDType(str, Enum):
    """How K/V rows are stored: a float type, or int8 / rotated int4 with a scale per group of 32
    (pipeline/model/kv/quant.py)."""
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    int8 = "int8"
    int4 = "int4"


def _choices(name: str, values: list[str]) -> type[Enum]:
    """A str Enum whose member names are its values: OmegaConf looks values up by name, and `8w` is no
    identifier, so these are built with the functional API (LinearScheme["8w"])."""
    return Enum(name, [(x, x) for x in values], type=str)


# a tiny random model's architecture: an HF model_type of the registry (pipeline/model/archs/<model_type>.py)
ModelType = _choices("ModelType", sorted(ARCHS))
# what a linear is in its layer, whatever the architecture names it (quantize.overrides[].role)
Role = _choices("Role", list(ROLES))
LinearScheme = _choices("LinearScheme", ["none", "8w", "4w", "8da4w", "8da8w", "nvfp4"])
EmbeddingScheme = _choices("EmbeddingScheme", ["none", "8w", "4w", "nvfp4"])
# the stages in build order (pipeline/stages checks its modules against it): run.until's choices
Stage = _choices("Stage", ["download", "wrap", "calibrate", "quantize", "export", "lower", "verify"])
# deliberately broken programs, for the gate's calibration (pipeline/model/layers/faults.py); never in a recipe
Fault = _choices("Fault", ["layer_permuted", "group_scale_doubled", "heads_swapped", "ring_one_short"])


class CacheMode(str, Enum):
    static = "static"
    custom = "custom"
    offgraph = "offgraph"
    stock = "stock"          # ExecuTorch's own LLM ops (llama::update_cache, llama::custom_sdpa), none of ours


class LogitsMode(str, Enum):
    full = "full"            # every row's logits [1, T, V]
    last = "last"            # the last row's [1, 1, V]
    # the last min(T, export.tail_rows) rows' [1, R, V]: a decode step computes one row, speculation's verify step
    # every row, and ExecuTorch's own runner (TextLLMRunner) drives it as it drives `last` (it reads the last row)
    tail = "tail"
    selected = "selected"    # forward takes a third input rows Long[R]: [1, R, V] (the batched runner's mode)
    auto = "auto"            # tail where the cache is in the program and the mode takes rows (custom), selected
                             # where the runtime owns it (offgraph), else last (full on the transformers route):
                             # pipeline/model/cache_modes logits_mode


class Exporter(str, Enum):
    native = "native"                # wrap -> torch.export -> lower: one runner-layout program (model.pte)
    transformers = "transformers"    # transformers.exporters.ExecutorchExporter: prefill.pte + decode.pte,
                                     # KV cache as program input/output


class BackendName(str, Enum):
    xnnpack = "xnnpack"
    portable = "portable"
    mlx = "mlx"


@dataclass
class RandomModelConfig:
    """Geometry of a tiny random model (source=random): the common dims, plus what its architecture's entry adds
    (pipeline/model/archs: `tiny`, `random_config`)."""
    arch: ModelType = ModelType["llama"]
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    sliding_window: Optional[int] = None      # gemma3/gemma4 only
    sliding_window_pattern: int = 6           # gemma3/gemma4: every Nth layer is full attention
    # gemma4 only: global (full-attention) layers' own head dim and KV heads (0 = as the sliding ones),
    # per-layer input embeddings (0 = none), trailing layers that read another layer's K/V, values = keys
    # on global layers, and shared layers' MLP twice as wide
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    hidden_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    # qwen3_5_text, qwen3_next: the Gated DeltaNet layers' key heads, value heads and head dim (0 = the attention's KV
    # heads, query heads and head dim)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_head_dim: int = 0
    tie_word_embeddings: bool = True
    seed: int = 0


@dataclass
class ModelConfig:
    name: str = MISSING
    source: Source = Source.gguf
    # hf
    repo_id: Optional[str] = None
    revision: Optional[str] = None            # a commit sha; a branch name is resolved and recorded
    allow_patterns: List[str] = field(default_factory=lambda: [
        "*.json", "*.safetensors", "tokenizer.model", "*.txt"])
    trust_remote_code: bool = False
    # local folder / gguf file
    path: Optional[str] = None
    # gguf shipped by an installed Python distribution
    package: Optional[str] = None
    gguf_pattern: str = "*.gguf"
    # random
    random: RandomModelConfig = field(default_factory=RandomModelConfig)
    # a fine-tune's PEFT LoRA adapter (a folder: adapter_config.json and its weights; pipeline/model/adapter.py)
    adapter: Optional[str] = None
    adapter_mode: AdapterMode = AdapterMode.merge


class QuantAlgorithm(str, Enum):
    minmax = "minmax"   # scales from each group's min/max (torchao's affine default)
    hqq = "hqq"         # torchao's scale-only HQQ: scales fitted to the group (ExecuTorch's LLM export default)
    # GPTQ over the calibration text's Hessians, with importance-weighted scales (pipeline/model/quant/gptq.py; the
    # calibrate stage measures them)
    gptq = "gptq"


@dataclass
class ModuleOverride:
    """Linears whose name matches `pattern` (fnmatch, e.g. '*.mlp.down_proj'), or whose `role` in the layer is this
    one (e.g. `down`: the MLP's and every expert's output projection, whatever the architecture calls it; `v` also
    takes a fused qkv, `up` a fused gate_up), take their own scheme. Exactly one of the two."""
    pattern: Optional[str] = None
    role: Optional[Role] = None
    scheme: LinearScheme = MISSING
    group_size: int = 32                      # 0 = per output channel


@dataclass
class QuantizeConfig:
    linear: LinearScheme = LinearScheme["none"]
    linear_group_size: int = 32               # 0 = per output channel
    embedding: EmbeddingScheme = EmbeddingScheme["none"]
    embedding_group_size: int = 32            # 0 = per row
    lm_head: Optional[LinearScheme] = None    # null: as the linears (or the embedding's weight, when re-tied)
    lm_head_group_size: int = 0               # 0 = per output channel (used when lm_head is set)
    overrides: List[ModuleOverride] = field(default_factory=list)  # first match wins; before `linear`
    algorithm: QuantAlgorithm = QuantAlgorithm.minmax
    # a GGUF source: where the scheme holds the file's own grid exactly (Q8_0 -> 8 bits in groups of 32; Q4_0, and
    # on backends with asymmetric weights Q4_1 -> 4 bits in groups of 32), carry it instead of re-quantizing
    source_grid: bool = False
    # SmoothQuant's alpha in (0, 1): move activation outliers into the weights before quantizing (float model
    # unchanged; pipeline/model/quant/smoothing.py); null: off
    smoothing: Optional[float] = None
    tie_word_embeddings: bool = True          # re-tie lm_head when the model ties and schemes are equal
    # file bits/weight the linears' schemes are chosen for (pipeline/model/quant/allocate.py: each linear's measured KLD
    # cost at each scheme the backend offers, the least total within the target); null: `linear` and `overrides`
    target_bpw: Optional[float] = None


@dataclass
class CacheConfig:
    mode: CacheMode = CacheMode.static
    # the reference's two switches; which values a mode takes is declared by the mode
    # (pipeline/model/cache_modes/<mode>.py: FLAGS) and checked by preflight
    custom_sdpa: bool = False
    custom_kv_cache: bool = False
    # K/V storage of the in-graph fused cache (custom, both flags): null = export.dtype. Half storage halves the
    # bytes attention reads per token, int8 rows (a scale per 32 values) nearly quarter them, rotated int4 rows take
    # 28 % of fp16's; off-graph programs choose theirs at run time (verify.runtime.kv_storage_dtype)
    kv_dtype: Optional[KvDType] = None
    # store (k - m) * a and attend with q / a: m each layer's mean key per KV head (after RoPE), a a power-of-two scale
    # per channel weighing it by the queries' energy, both measured on the calibration corpus at wrap. The scores
    # move by a constant per query (softmax unchanged); int4 rows round where the queries read least
    # (pipeline/model/layers/key_calibration.py). null: where K may be stored in int4 (cache.kv_dtype=int4, and
    # off-graph programs on backends whose runtimes store int4); custom (both flags) and offgraph only, no sink logits
    calibrate_keys: Optional[bool] = None


@dataclass
class ExportConfig:
    max_context_len: int = 512
    # max_seq_len: the traced T is in [1, chunk]; null: the largest up to 128 the model allows (preflight says)
    prefill_chunk: Optional[int] = None
    dtype: DType = DType.fp32
    logits_mode: LogitsMode = LogitsMode.auto
    # logits mode `tail`: the most rows a forward returns (speculation's verify step: the drafts + 1; XNNPACK runs
    # GEMMs of up to 4 rows with the 1-row kernel's bits)
    tail_rows: int = 4
    # torch.export's strict mode (dynamo); null: non-strict where the backend and the cache mode take it, in fp32
    # (pipeline/exporters/native.py strict_export), strict elsewhere
    strict: Optional[bool] = None
    exporter: Exporter = Exporter.native      # who exports and lowers: pipeline/exporters/<name>.py
    fault: Optional[Fault] = None             # break the captured module on purpose (gate calibration, tests)
    # q/k/v and gate/up, each run as one wider linear (pipeline/model/layers/fused_projections.py): the same bits,
    # fewer operators per token; fp32 programs only
    fuse_projections: bool = True
    # a tied lm_head re-tied to an 8-bit per-row embedding runs on llmpipe::tied_head over the embedding's table, which
    # the program then stores once (pipeline/model/layers/tied_head.py); false: the backend runs its own copy
    # (XNNPACK's)
    store_tied_once: bool = True


@dataclass
class BackendConfig:
    name: BackendName = BackendName.xnnpack
    quant_fusion: bool = True                 # do_quant_fusion_and_const_prop


@dataclass
class Thresholds:
    """A null threshold is reported but not enforced."""
    min_greedy_match: Optional[int] = None    # leading greedy tokens that must agree; -1 = all
    max_logit_err: Optional[float] = None
    min_top1: Optional[float] = None
    max_kld: Optional[float] = None
    max_kld_ratio: Optional[float] = None     # vs_float: KLD <= ratio x the eager quantized model's own KLD
    # same_quant: mean KLD <= this x the build's numerics floor (pipeline/model/quant/float_noise.py) + 1e-4
    max_kld_over_floor: Optional[float] = None
    # the thresholds above hold for each prompt (true), or for the figures over all prompts (false: where
    # last-bit noise alone moves one short prompt's figures by a token or two)
    per_prompt: bool = True


@dataclass
class Gate:
    """What verify holds a program to."""
    # the program against the eager model with the same quantization: did export and lowering preserve it?
    same_quant: Thresholds = field(default_factory=Thresholds)
    # the program against the unquantized eager model: what did quantization cost?
    vs_float: Thresholds = field(default_factory=Thresholds)


class GateChoice(str, Enum):
    auto = "auto"        # `dynamic` when any scheme quantizes activations at run time, else `half` for fp16/bf16
                         # builds, else `exact`
    exact = "exact"      # fp32 float and weight-only builds: the program computes what eager computes
    half = "half"        # fp16 / bf16: the program and eager round each op to the half type in their own order
    dynamic = "dynamic"  # 8da4w / 8da8w: the backend rounds activations its own way


@dataclass
class RuntimeCacheConfig:
    """How verify runs an off-graph program's runtime-owned cache (runner flags; no re-export needed)."""
    kv_max_capacity: Optional[int] = None     # positions; null = export.max_context_len
    kv_initial_capacity: int = 512            # flat pools start here and double up to the capacity
    kv_windows: Optional[List[int]] = None    # pattern repeated over the caches, 0 = flat; null = the program's
    kv_storage_dtype: Optional[KvDType] = None  # null = the program's activation dtype


@dataclass
class VerifyConfig:
    enabled: bool = True
    prompts: List[str] = field(default_factory=lambda: [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue.",
        "List three uses for a paperclip.",
    ])
    # also a prompt of corpus prose (bench/corpus) that crosses the prefill chunk: chunk + 16 tokens (within the
    # context), so a chunked prefill and, on sliding-window models with short rings, a wrap are checked
    long_prompt: bool = True
    chat: bool = True                         # apply the tokenizer's chat template when it has one
    # also run the C++ runner: its tokens must equal the Python runtime's; null: where it runs the backend's programs
    native: Optional[bool] = None
    batched: bool = False                     # offgraph: the prompts as sessions of llm_batched_runner must equal
                                              # their single-session C++ runs (greedy)
    max_new_tokens: int = 16
    # > 0: also score the program against the float model on that many chunks of the fidelity corpus
    # (pipeline/fidelity.py: KLD mean/median/p99/max, same top-1, RMS delta-p, perplexities), for sweeps to rank by
    fidelity_chunks: int = 0
    # backend=mlx: an instruction the interpreter cannot run makes verify's status `unsupported: <op>`;
    # true fails the gate (the default), false records the status and skips the checks
    fail_on_unsupported: bool = True
    runtime: RuntimeCacheConfig = field(default_factory=RuntimeCacheConfig)
    gate: GateChoice = GateChoice.auto        # which of the gates below applies (thresholds: conf/verify/*.yaml)
    exact: Gate = field(default_factory=Gate)
    half: Gate = field(default_factory=Gate)
    dynamic: Gate = field(default_factory=Gate)


@dataclass
class RunConfig:
    output_dir: str = "outputs"               # must stay inside <project>/outputs
    progress: bool = True
    until: Optional[Stage] = None             # last stage to run (e.g. lower: build without verify)
    # a remote stage store shared by hosts (file:///shared/dir, s3://bucket/prefix; pipeline/store/remote.py): the
    # local cache reads through it; credentials come from the environment, never from here
    store_url: Optional[str] = None
    store_lease_s: float = 60.0               # a remote builder's claim not renewed for this long is a dead one's


@dataclass
class PipelineConfig:
    model: ModelConfig = MISSING
    quantize: QuantizeConfig = MISSING
    cache: CacheConfig = MISSING
    export: ExportConfig = MISSING
    backend: BackendConfig = MISSING
    verify: VerifyConfig = MISSING
    run: RunConfig = field(default_factory=RunConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "quantize": QuantizeConfig,
    "cache": CacheConfig,
    "export": ExportConfig,
    "backend": BackendConfig,
    "verify": VerifyConfig,
}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="pipeline_schema", node=PipelineConfig)
    for group, schema in GROUP_SCHEMAS.items():
        # group files start with `defaults: [/schema/<group>@_here_]`
        cs.store(group="schema", name=group, node=schema)
