"""Inputs for native/tests/cores_test.cpp (every ISA path's numeric cores), and its outputs held against the Python
twins: the tied head bit for bit (tied_head_int_ref: exact integer sums), the gated delta rule, the causal conv and
Mamba-2's scan within float tolerance (float64 twins), the experts as the scalar path gives them (cores_test checks
every other path equals it bit for bit; tests/native/test_experts_kernel.py holds the kernel to its twin)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.model.layers.gated_delta import gated_delta_rule_ref
from pipeline.model.layers.recurrent import causal_conv_ref
from pipeline.model.layers.ssd import ssd_scan_ref
from pipeline.model.layers.tied_head import tied_head_int_ref

TIED = {"T": 3, "D": 4133, "V": 37}  # past two int32 chunks of 2048 columns, every remainder loop
DELTA = {"T": 70, "Hk": 2, "Hv": 4, "Dk": 16, "Dv": 24, "pos": 5, "scale": 0.25}  # a chunk of 64 and a part
CONV = {"T": 9, "C": 40, "K": 4, "pos": 3, "silu": 1}
SSD = {"T": 70, "H": 4, "P": 24, "G": 2, "N": 16, "pos": 5}  # a chunk of 64 and a part; two heads a group


def write_inputs(d: Path) -> dict:
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {"tied_x": r(TIED["T"], TIED["D"]), "tied_w": torch.randint(-127, 128, (TIED["V"], TIED["D"]), generator=g,
                                                                         dtype=torch.int8),
         "tied_s": torch.rand(TIED["V"], generator=g) * 0.02}
    T, Hk, Hv, Dk, Dv = (DELTA[k] for k in ("T", "Hk", "Hv", "Dk", "Dv"))
    t.update(delta_q=r(T, Hk, Dk), delta_k=r(T, Hk, Dk), delta_v=r(T, Hv, Dv), delta_a=r(T, Hv), delta_b=r(T, Hv),
             delta_A_log=r(Hv) * 0.5, delta_dt_bias=r(Hv) * 0.5, delta_state=r(Hv, Dk, Dv) * 0.1)
    t.update(conv_x=r(CONV["T"], CONV["C"]), conv_w=r(CONV["C"], CONV["K"]), conv_bias=r(CONV["C"]),
             conv_state=r(CONV["K"] - 1, CONV["C"]))
    T, H, P, G, N = (SSD[k] for k in ("T", "H", "P", "G", "N"))
    t.update(ssd_x=r(T, H, P), ssd_dt=r(T, H), ssd_A_log=r(H) * 0.5, ssd_dt_bias=r(H) * 0.5, ssd_D=r(H),
             ssd_B=r(T, G, N), ssd_C=r(T, G, N), ssd_state=r(H, N, P) * 0.1)
    for name, x in t.items():
        (d / (name + (".i8" if x.dtype == torch.int8 else ".f32"))).write_bytes(x.contiguous().numpy().tobytes())
    lines = [f"tied_{k} {v}" for k, v in TIED.items()] + [f"delta_{k} {v}" for k, v in DELTA.items()] + \
        [f"conv_{k} {v}" for k, v in CONV.items()] + [f"ssd_{k} {v}" for k, v in SSD.items()]
    (d / "dims.txt").write_text("\n".join(lines) + "\n")
    return t


def output(d: Path, name: str, path: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(d / f"{name}_{path}.f32", dtype=np.float32))


def check_against_twins(t: dict, out: Path, path: str) -> None:
    """One path's outputs against the twins (AssertionError naming the kernel)."""
    tied = output(out, "tied", path).reshape(TIED["T"], TIED["V"])
    assert torch.equal(tied, tied_head_int_ref(t["tied_x"], t["tied_w"], t["tied_s"])), f"tied head, {path}"
    state = t["delta_state"].clone()
    T = DELTA["T"]
    want = gated_delta_rule_ref(*(t[f"delta_{k}"][None] for k in "qkvab"), t["delta_A_log"], t["delta_dt_bias"],
                                state, torch.arange(DELTA["pos"], DELTA["pos"] + T), DELTA["scale"])
    got = output(out, "delta_out", path).reshape(want.shape)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), f"gated delta out, {path}"
    got_state = output(out, "delta_state", path).reshape(state.shape)
    assert (got_state - state).abs().max() <= 1e-5 * max(1.0, state.abs().max().item()), f"gated delta state, {path}"
    cstate = t["conv_state"].clone()
    want = causal_conv_ref(t["conv_x"][None], t["conv_w"], t["conv_bias"], cstate,
                           torch.arange(CONV["pos"], CONV["pos"] + CONV["T"]), CONV["silu"])
    got = output(out, "conv_out", path).reshape(want.shape)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), f"causal conv out, {path}"
    assert torch.equal(output(out, "conv_state", path).reshape(cstate.shape), cstate), f"causal conv state, {path}"
    sstate = t["ssd_state"].clone()
    want = ssd_scan_ref(t["ssd_x"][None], t["ssd_dt"][None], t["ssd_A_log"], t["ssd_dt_bias"], t["ssd_B"][None],
                        t["ssd_C"][None], t["ssd_D"], sstate, torch.arange(SSD["pos"], SSD["pos"] + SSD["T"]))
    got = output(out, "ssd_out", path).reshape(want.shape)
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), f"ssd scan out, {path}"
    got_state = output(out, "ssd_state", path).reshape(sstate.shape)
    assert (got_state - sstate).abs().max() <= 1e-5 * max(1.0, sstate.abs().max().item()), f"ssd scan state, {path}"
