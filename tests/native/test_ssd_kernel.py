"""Mamba-2's scan, llmpipe::ssd_scan: the Python twin (pipeline/model/layers/ssd.py) against HF's own chunked scan
(Bamba's mamba2_chunk_scan) in pieces, its chunked form against the token-by-token recurrence, and the C++ kernel
(native/src/kernels/ssd_kernel.cpp, the active ISA path's core) in the ExecuTorch runtime against the twin, the state
carried in the program's buffer across steps of any length."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.layers.ssd import DT_MAX, ssd_scan_ref, ssd_scan_steps
from pipeline.ops import load_native_kernels

T, H, P, G, N = 150, 4, 8, 2, 16   # 150 tokens: two full chunks of 64 and a partial one; two heads a group


def inputs(strong_decay: bool, seed: int = 0, T: int = T):
    """x, dt, A_log, dt_bias, B, C, D. HF initializes A to 1..heads; a strong decay takes A up to 16."""
    g = torch.Generator().manual_seed(seed)
    x, dt = torch.randn(1, T, H, P, generator=g), torch.randn(1, T, H, generator=g)
    A = torch.empty(H).uniform_(1, 16, generator=g) if strong_decay else torch.full((H,), 0.05)
    B, C = torch.randn(1, T, G, N, generator=g), torch.randn(1, T, G, N, generator=g)
    return x, dt, A.log(), torch.randn(H, generator=g), B, C, torch.randn(H, generator=g)


def hf_scan(x, dt, A_log, dt_bias, B, C, D, state=None, limits=(0.0, float("inf"))):
    """transformers' own chunked scan as Bamba's mixer calls it: (out, final state as ours: [H, N, P])."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
    out, final = mamba2_chunk_scan(x, dt, -A_log.exp(), B, C, chunk_size=32, D=D, dt_bias=dt_bias, dt_softplus=True,
                                   initial_states=None if state is None else state.transpose(1, 2)[None],
                                   dt_limit=limits, return_final_states=True)
    return out, final[0].transpose(1, 2)


def in_pieces(scan, x, piece: int, state: torch.Tensor, start: int = 0, limits=(0.0, DT_MAX)) -> torch.Tensor:
    xs, dt, A_log, dt_bias, B, C, D = x
    outs = []
    for p in range(0, xs.shape[1], piece):
        e = min(xs.shape[1], p + piece)
        outs.append(scan(xs[:, p:e], dt[:, p:e], A_log, dt_bias, B[:, p:e], C[:, p:e], D, state,
                         torch.arange(start + p, start + e), *limits))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("strong_decay", [False, True], ids=["mild", "strong"])
@pytest.mark.parametrize("piece", [1, 7, 64, T], ids=lambda p: f"piece{p}")
def test_twin_equals_hf_in_pieces(strong_decay, piece):
    """A step of any length, the state carried between steps: HF's result over the whole sequence, and its state."""
    x = inputs(strong_decay)
    want, want_state = hf_scan(*x)
    state = torch.full((H, N, P), 7.0)  # a step at position 0 starts over
    got = in_pieces(ssd_scan_ref, x, piece, state)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() < 2e-6 * scale
    assert (state - want_state).abs().max().item() < 2e-6 * max(1.0, want_state.abs().max().item())


def test_chunked_form_equals_the_recurrence_and_the_time_step_limits_hold():
    """From a nonzero state (a step at position 5): the chunked form and the token-by-token scan, and HF's with the
    same state and a clamped time step (Nemotron-H's time_step_min)."""
    x = inputs(True, seed=1)
    init = torch.randn(H, N, P)
    limits = (0.5, 2.0)
    s1, s2 = init.clone(), init.clone()
    chunked = in_pieces(ssd_scan_ref, x, T, s1, start=5, limits=limits)
    steps = in_pieces(ssd_scan_steps, x, T, s2, start=5, limits=limits)
    assert (chunked - steps).abs().max().item() < 1e-5 and (s1 - s2).abs().max().item() < 1e-5
    want, want_state = hf_scan(*x, state=init, limits=limits)
    assert (chunked - want).abs().max().item() < 1e-5 and (s1 - want_state).abs().max().item() < 1e-5
    unclamped = in_pieces(ssd_scan_ref, x, T, init.clone(), start=5)
    assert (unclamped - chunked).abs().max().item() > 1e-2  # the limits took effect


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(1, 3, 3, P), dt=torch.zeros(1, 3, 3), A_log=torch.zeros(3), dt_bias=torch.zeros(3),
          D=torch.zeros(3), state=torch.zeros(3, N, P)), "multiple of"),
    (dict(state=torch.zeros(H, N, P, dtype=torch.float64)), "state must be fp32"),
    (dict(position=torch.tensor([0, 2, 3])), "consecutive"),
    (dict(dt=torch.zeros(1, 3, H + 1)), "dt must be"),
])
def test_twin_refuses_bad_shapes(bad, match):
    args = dict(x=torch.zeros(1, 3, H, P), dt=torch.zeros(1, 3, H), A_log=torch.zeros(H), dt_bias=torch.zeros(H),
                B=torch.zeros(1, 3, G, N), C=torch.zeros(1, 3, G, N), D=torch.zeros(H), state=torch.zeros(H, N, P),
                position=torch.arange(3))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ssd_scan_ref(**args)


class _Layer(nn.Module):
    """The op over a state buffer of the program, as a Mamba-2 layer holds it in the `custom` cache mode."""

    def __init__(self, A_log, dt_bias, D):
        super().__init__()
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D), ("state", torch.zeros(H, N, P))):
            self.register_buffer(name, t)

    def forward(self, x, dt, B, C, position):
        return torch.ops.llmpipe.ssd_scan(x, dt, self.A_log, self.dt_bias, B, C, self.D, self.state, position, 0.0,
                                          DT_MAX)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.runtime import Runtime
    x = inputs(True, seed=2)
    xs, dt, A_log, dt_bias, B, C, D = x
    n = torch.export.Dim("n", min=1, max=256)
    example = (xs[:, :3], dt[:, :3], B[:, :3], C[:, :3], torch.arange(3))
    with torch.no_grad():
        ep = torch.export.export(_Layer(A_log, dt_bias, D), example,
                                 dynamic_shapes=({1: n}, {1: n}, {1: n}, {1: n}, {0: n}))
    path = tmp_path_factory.mktemp("ssd") / "op.pte"
    path.write_bytes(to_edge(ep).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True)).buffer)
    load_native_kernels()
    return Runtime.get().load_program(str(path)).load_method("forward"), x


@pytest.mark.parametrize("pieces", [[150], [1] * 5 + [64, 1, 80], [7] * 21 + [3]], ids=["one", "mixed", "sevens"])
def test_kernel_equals_twin_across_steps(program, pieces):
    """The kernel's steps (decode rows, a chunk and a half, sevens), the state in the program across executes, against
    the twin; then a step at position 0 starts a new sequence."""
    method, (xs, dt, A_log, dt_bias, B, C, D) = program
    twin_state = torch.zeros(H, N, P)
    pos = 0
    for n in pieces + [4]:
        if pos == sum(pieces):
            pos = 0  # a new sequence: the program's state must not leak into it
        sl = slice(pos, pos + n)
        args = [t[:, sl].contiguous() for t in (xs, dt, B, C)] + [torch.arange(pos, pos + n)]
        got = method.execute(args)[0]
        want = ssd_scan_ref(args[0], args[1], A_log, dt_bias, args[2], args[3], D, twin_state, args[4])
        assert got.shape == (1, n, H, P)
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item()), (pieces, pos, n)
        pos += n


def test_kernel_refuses_positions_that_skip(program, capfd):
    method, (xs, dt, A_log, dt_bias, B, C, D) = program
    args = [t[:, :3].contiguous() for t in (xs, dt, B, C)]
    method.execute(args + [torch.tensor([0, 1, 2])])
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="0x12"):  # Error::InvalidArgument, its reason in the kernel's log
        method.execute(args + [torch.tensor([4, 5, 7])])
    assert "llmpipe::ssd_scan: positions must be consecutive" in capfd.readouterr().err
