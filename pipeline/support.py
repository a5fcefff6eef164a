"""The support table: every architecture of the registry (pipeline/model/archs) by backend, cache mode and scheme
(`python -m pipeline support` prints it; the README's table is its Markdown).

A cell is what preflight answers for that combination: the backend's and the cache mode's refusals for the
architecture's entry (refuses_arch). Every "yes" cell is built and verified on a tiny random model of the family by
tests/e2e/test_families.py (its matrix: CI a family of each kind, the slow tier all of them).
"""
from __future__ import annotations

from typing import Optional

from pipeline.backends import BACKENDS
from pipeline.config import LinearScheme
from pipeline.model.archs import ARCHS, Arch
from pipeline.model.cache_modes import CACHE_MODES
from pipeline.paths import ROOT

# the (backend, cache mode) columns: XNNPACK in all four modes, MLX through the interpreter in its two
COLUMNS = (("xnnpack", "static"), ("xnnpack", "custom"), ("xnnpack", "offgraph"), ("xnnpack", "stock"),
           ("mlx", "custom"), ("mlx", "offgraph"))
MARKERS = ("<!-- archs-table:start -->", "<!-- archs-table:end -->")


def refusal(arch: Arch, backend: str, mode: str) -> Optional[str]:
    """Why this combination is not built (the backend's answer first), or None."""
    return BACKENDS[backend].refuses_arch(arch) or CACHE_MODES[mode].refuses_arch(arch, CACHE_MODES[mode].FLAGS[0])


def supported_cells() -> list[tuple[str, str, str]]:
    """(model_type, backend, cache mode) of every supported cell: what the family tests build."""
    return [(t, b, m) for t, a in sorted(ARCHS.items()) for b, m in COLUMNS if refusal(a, b, m) is None]


def schemes(backend: str) -> list[str]:
    """The linear schemes a backend builds at fp32 (in some group size: per channel, 16 or 32)."""
    return [s.value for s in LinearScheme if s.value != "none"
            and any(BACKENDS[backend].refuses(s.value, group) is None for group in (0, 16, 32))]


def layout(a: Arch) -> str:
    """What the entry declares, in a few words."""
    at, parts = a.attention, []
    if a.gated_delta:
        fused = f", fused {a.gated_delta.fused_qkvz} / {a.gated_delta.fused_ba}" if a.gated_delta.fused_qkvz else ""
        parts.append(f"Gated DeltaNet layers (recurrent state{fused})")
    if a.short_conv:
        parts.append("short-conv layers (recurrent state)")
    if a.mamba2:
        parts.append("Mamba-2 beside attention in every layer (recurrent state)" if a.mamba2.parallel else
                     "Mamba-2 layers (recurrent state)")
    if at.output_gate:
        parts.append("gated attention output")
    fused = [n for n in (at.qkv, a.mlp.gate_up) if n]
    if fused:
        parts.append("fused " + ", ".join(fused))
    if at.qk_norm:
        parts.append(f"q/k norm ({at.qk_norm})")
    if at.v_norm:
        parts.append("v norm")
    if not a.mlp.gate and not a.mlp.gate_up:
        parts.append("ungated MLP")
    if a.norms.placement != "pre" or a.norms.kind != "rms":
        parts.append(f"{a.norms.placement} {'LayerNorm' if a.norms.kind == 'layer' else 'norms'}")
    if a.experts is not None:
        shared = ", shared expert" if a.experts.shared else ""
        shared += ", float linear router" if a.experts.router_linear else ""
        parts.append(f"MoE ({a.experts.activation.replace('_', ' ')}{shared})")
    if at.sinks:
        parts.append("attention sinks")
    parts.append(a.rotary)
    parts += [x for x in (a.embedding_scale and f"embedding x {a.embedding_scale}", a.logits) if x]
    return "; ".join(parts)


def table(markdown: bool) -> str:
    reasons: list[str] = []
    head = ["model_type", "family", "layout"] + [f"{b} {m}" for b, m in COLUMNS]
    rows = []
    for t, a in sorted(ARCHS.items()):
        cells = []
        for b, m in COLUMNS:
            why = refusal(a, b, m)
            if why is None:
                cells.append("yes")
                continue
            if why not in reasons:
                reasons.append(why)
            cells.append(f"no [{reasons.index(why) + 1}]")
        rows.append([f"`{t}`" if markdown else t, a.family, layout(a)] + cells)
    notes = [f"[{i}] {why}" for i, why in enumerate(reasons, 1)]
    notes.append("Schemes: " + "; ".join(f"{b}: {', '.join(schemes(b))}" for b in dict(COLUMNS)) +
                 " (the experts take every one; the router and a shared expert's gate stay in float). fp32 under the "
                 "exact gate, the backend's default quantization under its gate, C++ runner tokens equal to the Python "
                 "runtime's on XNNPACK (stock: up to near-ties, the runner on twins of ExecuTorch's llama:: kernels).")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines + [""] + [n + "  " for n in notes]).rstrip()
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows] + [""] + notes)


def readme_with_table(text: str) -> str:
    start, end = MARKERS
    if start not in text or end not in text:
        raise ValueError(f"README.md has no {start} ... {end} block")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    return f"{before}{start}\n{table(markdown=True)}\n{end}{after}"
