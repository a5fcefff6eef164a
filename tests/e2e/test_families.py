"""Every supported cell of the support table (python -m pipeline support) built and verified on a tiny random model of
its family: fp32 under the exact gate and the backend's default quantization under its gate, through the whole
pipeline (wrap, quantize, export, lower, verify); on XNNPACK the C++ runner's tokens equal the Python runtime's, and
MLX programs run in the interpreter. Sliding-window families are built at a chunk of their window (the fitted
default), so verify's long prompt (chunk + 16 tokens) runs past the window and wraps the rings.

The CI tier builds one family of each kind (fused projections, post-norm, mixture of experts, attention sinks,
recurrent layers of each kind, Mamba-2 blocks with ungated experts, attention beside Mamba-2, and on MLX a dense one
and a MoE); the slow tier
(`pytest -m slow tests/e2e/test_families.py`) builds every cell.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.support import supported_cells
from pipeline.config import Thresholds
from pipeline.model import archs
from tests.helpers import compose_cfg
from tests.model.test_archs import tiny_overrides

# each slow cell is a tiny build of its own: the slow tier's rotation takes them one by one (tests/rotation.py)
ROTATE_EACH_TEST = True
# quantize: none (fp32, the exact gate) or the backend's default (quantize/default_<backend>.yaml)
SCHEMES = ("fp32", "default")
# one family of each new kind, in the CI tier: (model_type, backend, cache mode, scheme)
CI_CELLS = [("phi3", "xnnpack", "custom", "default"), ("phi3", "xnnpack", "offgraph", "fp32"),
            ("olmo2", "xnnpack", "custom", "default"), ("olmo2", "xnnpack", "static", "fp32"),
            ("qwen3_moe", "xnnpack", "custom", "default"), ("qwen3_moe", "xnnpack", "offgraph", "fp32"),
            ("gpt_oss", "xnnpack", "offgraph", "default"), ("gpt_oss", "xnnpack", "custom", "fp32"),
            ("phi3", "mlx", "offgraph", "fp32"), ("qwen3_moe", "mlx", "custom", "default"),
            ("qwen3_5_text", "xnnpack", "custom", "default"), ("lfm2", "xnnpack", "custom", "fp32"),
            ("lfm2", "xnnpack", "offgraph", "fp32"), ("qwen3_next", "xnnpack", "offgraph", "default"),
            ("nemotron_h", "xnnpack", "custom", "default"), ("falcon_h1", "xnnpack", "offgraph", "fp32")]
ALL_CELLS = [(t, b, m, s) for t, b, m in supported_cells() for s in SCHEMES]


def build_family(model_type: str, backend: str, mode: str, scheme: str, *extra: str) -> dict:
    """A tiny random model of the family through the whole pipeline; its run manifest. Random weights: what
    quantization costs against float means nothing, so a quantized build is gated on its fidelity to the eager
    model of the same quantization (same_quant) only, as `validate --smoke` does."""
    from pipeline.session import build
    overrides = [*tiny_overrides(model_type), f"backend={backend}", f"cache={mode}", "export.max_context_len=96",
                 "verify.max_new_tokens=12", "run.progress=false"] + (["quantize=none"] if scheme == "fp32" else []) + \
        list(extra)
    cfg = compose_cfg(*overrides)
    if scheme != "fp32":
        for gate in ("exact", "half", "dynamic"):
            cfg.verify[gate].vs_float = OmegaConf.structured(Thresholds)
    return build(cfg, recipe=f"family {model_type} {backend} {mode} {scheme}")


def _wrap_spec(m: dict) -> dict:
    wrap = next(s for s in m["stages"] if s["name"] == "wrap")
    return json.loads((Path(wrap["path"]) / "wrap.json").read_text())


def check(m: dict, backend: str) -> None:
    assert m["status"] == "ok", m.get("error")
    if m["config"]["quantize"]["linear"] == "none":
        assert m["verify"]["gate"] == "exact"
    if backend == "xnnpack":  # the C++ runner's tokens equal the Python runtime's
        assert m["verify"]["native"]["token_parity"] is True
    spec = _wrap_spec(m)
    if "sliding_attention" in spec["layer_types"]:
        verify = next(s for s in m["stages"] if s["name"] == "verify")
        prompts = json.loads((Path(verify["path"]) / "report.json").read_text())["prompts"]
        assert max(p["prompt_tokens"] for p in prompts) > spec["sliding_window"] >= spec["prefill_chunk"]


@pytest.mark.parametrize("model_type,backend,mode,scheme", CI_CELLS, ids=lambda x: str(x))
def test_a_family_of_each_kind_builds_and_verifies(model_type, backend, mode, scheme):
    check(build_family(model_type, backend, mode, scheme), backend)


@pytest.mark.slow
@pytest.mark.parametrize("model_type,backend,mode,scheme", ALL_CELLS, ids=lambda x: str(x))
def test_every_supported_cell_builds_and_verifies(model_type, backend, mode, scheme):
    check(build_family(model_type, backend, mode, scheme), backend)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["quantize=4w", "quantize=8w", "quantize=8da4w",
                                    "quantize=8da4w quantize.linear=8da8w quantize.linear_group_size=0"])
@pytest.mark.parametrize("model_type", ["phi3", "glm4", "qwen3_moe"])
def test_fused_projections_and_experts_take_every_scheme(model_type, scheme):
    """Phi-3's fused qkv and gate_up, GLM-4's fused gate_up, Qwen3-MoE's experts: each linear scheme alone."""
    from pipeline.session import build
    cfg = compose_cfg(*tiny_overrides(model_type), *scheme.split(), "export.max_context_len=96",
                      "verify.max_new_tokens=12", "run.progress=false")
    for gate in ("exact", "half", "dynamic"):
        cfg.verify[gate].vs_float = OmegaConf.structured(Thresholds)
    check(build(cfg, recipe=f"scheme {model_type} {scheme}"), "xnnpack")


def test_the_ci_cells_are_supported_cells():
    assert {c[:3] for c in CI_CELLS} <= set(supported_cells())
    kinds = {"fused": "phi3", "post-norm": "olmo2", "experts": "qwen3_moe", "sinks": "gpt_oss",
             "delta": "qwen3_5_text", "conv": "lfm2"}
    assert archs.ARCHS[kinds["fused"]].attention.qkv and archs.ARCHS[kinds["post-norm"]].norms.placement == "post"
    assert archs.ARCHS[kinds["experts"]].experts and archs.ARCHS[kinds["sinks"]].attention.sinks
    assert archs.ARCHS[kinds["delta"]].gated_delta and archs.ARCHS[kinds["conv"]].short_conv
