"""The recurrent layers' ops. llmpipe::gated_delta_rule: the Python twin (pipeline/model/layers/gated_delta.py) against
HF's own gated delta rule, its chunked form against the token-by-token recurrence, and the C++ kernel
(native/src/kernels/gated_delta_kernel.cpp) in the ExecuTorch runtime against the twin, the state carried in the
program's buffer across steps of any length. llmpipe::causal_conv (pipeline/model/layers/recurrent.py, its kernel
native/src/kernels/causal_conv_kernel.cpp): in pieces against one causal conv over the whole sequence."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.model.layers.gated_delta import gated_delta_rule_ref, gated_delta_rule_steps
from pipeline.model.layers.recurrent import causal_conv_ref
from pipeline.ops import load_native_kernels

T, HK, HV, DK, DV = 150, 2, 4, 16, 8   # 150 tokens: two full chunks of 64 and a partial one
SCALE = DK ** -0.5


def inputs(strong_decay: bool, seed: int = 0, T: int = T, hk: int = HK):
    """q, k, v, a, b, A_log, dt_bias. HF initializes A in U(0, 16): strong decay (g down to about -40 a token)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, hk, DK, generator=g), torch.randn(1, T, hk, DK, generator=g)
    v = torch.randn(1, T, HV, DV, generator=g)
    a, b = torch.randn(1, T, HV, generator=g), torch.randn(1, T, HV, generator=g) * 2
    A = torch.empty(HV).uniform_(0.01, 16, generator=g) if strong_decay else torch.full((HV,), 0.05)
    return q, k, v, a, b, A.log(), torch.randn(HV, generator=g)


def hf_rule(q, k, v, a, b, A_log, dt_bias, state=None):
    """transformers' own chunked gated delta rule as Qwen3.5's layer calls it: (out, final state)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    out, final = torch_chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), initial_state=state, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    return out, final[0]


def in_pieces(rule, x, piece: int, state: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Run `rule` over the step in pieces of `piece` tokens, the state carried; positions from `start`."""
    q, k, v, a, b, A_log, dt_bias = x
    outs = []
    for p in range(0, q.shape[1], piece):
        e = min(q.shape[1], p + piece)
        outs.append(rule(q[:, p:e], k[:, p:e], v[:, p:e], a[:, p:e], b[:, p:e], A_log, dt_bias, state,
                         torch.arange(start + p, start + e), SCALE))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("strong_decay", [False, True], ids=["mild", "strong"])
@pytest.mark.parametrize("piece", [1, 7, 64, T], ids=lambda p: f"piece{p}")
def test_twin_equals_hf_in_pieces(strong_decay, piece):
    """A step of any length, the state carried between steps: HF's result over the whole sequence, and its state."""
    x = inputs(strong_decay)
    want, want_state = hf_rule(*x)
    state = torch.full((HV, DK, DV), 7.0)  # a step at position 0 starts over
    got = in_pieces(gated_delta_rule_ref, x, piece, state)
    assert (got - want).abs().max().item() < 2e-6
    assert (state - want_state).abs().max().item() < 2e-6


def test_chunked_form_equals_the_recurrence():
    """From a nonzero state (a step at position 5), GQA 1:4: the chunked form and the token-by-token rule."""
    x = inputs(True, seed=1, hk=1)
    init = torch.randn(HV, DK, DV)
    s1, s2 = init.clone(), init.clone()
    chunked = in_pieces(gated_delta_rule_ref, x, T, s1, start=5)
    steps = in_pieces(gated_delta_rule_steps, x, T, s2, start=5)
    assert (chunked - steps).abs().max().item() < 1e-6 and (s1 - s2).abs().max().item() < 1e-6
    want, want_state = hf_rule(*x, state=init[None])
    assert (chunked - want).abs().max().item() < 2e-6 and (s1 - want_state).abs().max().item() < 2e-6


@pytest.mark.parametrize("bad,match", [
    (dict(v=torch.zeros(1, 3, 3, DV)), "multiple of"),
    (dict(state=torch.zeros(HV, DK, DV, dtype=torch.float64)), "state must be fp32"),
    (dict(position=torch.tensor([0, 2, 3])), "consecutive"),
    (dict(a=torch.zeros(1, 3, HV + 1)), "a, b must be"),
])
def test_twin_refuses_bad_shapes(bad, match):
    args = dict(q=torch.zeros(1, 3, HK, DK), k=torch.zeros(1, 3, HK, DK), v=torch.zeros(1, 3, HV, DV),
                a=torch.zeros(1, 3, HV), b=torch.zeros(1, 3, HV), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
                state=torch.zeros(HV, DK, DV), position=torch.arange(3), scale=SCALE)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        gated_delta_rule_ref(**args)


class _Layer(nn.Module):
    """The op over a state buffer of the program, as a Gated DeltaNet layer holds it in the `custom` cache mode."""

    def __init__(self, A_log, dt_bias):
        super().__init__()
        self.register_buffer("A_log", A_log)
        self.register_buffer("dt_bias", dt_bias)
        self.register_buffer("state", torch.zeros(HV, DK, DV))

    def forward(self, q, k, v, a, b, position):
        return torch.ops.llmpipe.gated_delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, self.state, position, SCALE)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.runtime import Runtime
    x = inputs(True, seed=2)
    n = torch.export.Dim("n", min=1, max=256)
    example = tuple(t[:, :3] for t in x[:5]) + (torch.arange(3),)
    with torch.no_grad():
        ep = torch.export.export(_Layer(x[5], x[6]), example,
                                 dynamic_shapes=({1: n}, {1: n}, {1: n}, {1: n}, {1: n}, {0: n}))
    path = tmp_path_factory.mktemp("gdr") / "op.pte"
    path.write_bytes(to_edge(ep).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True)).buffer)
    load_native_kernels()
    return Runtime.get().load_program(str(path)).load_method("forward"), x


@pytest.mark.parametrize("pieces", [[150], [1] * 5 + [64, 1, 80], [7] * 21 + [3]], ids=["one", "mixed", "sevens"])
def test_kernel_equals_twin_across_steps(program, pieces):
    """The kernel's steps (decode rows, a chunk and a half, sevens), the state in the program across executes, against
    the twin; then a step at position 0 starts a new sequence."""
    method, x = program
    q, k, v, a, b, A_log, dt_bias = x
    twin_state = torch.zeros(HV, DK, DV)
    pos = 0
    for n in pieces + [4]:
        if pos == sum(pieces):
            pos = 0  # a new sequence: the program's state must not leak into it
        sl = slice(pos, pos + n)
        args = [t[:, sl].contiguous() for t in (q, k, v, a, b)] + [torch.arange(pos, pos + n)]
        got = method.execute(args)[0]
        want = gated_delta_rule_ref(*args[:5], A_log, dt_bias, twin_state, args[5], SCALE)
        assert got.shape == (1, n, HV, DV)
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item()), (pieces, pos, n)
        pos += n


def test_kernel_refuses_positions_that_skip(program, capfd):
    method, x = program
    args = [t[:, :3].contiguous() for t in x[:5]]
    method.execute(args + [torch.tensor([0, 1, 2])])  # the same inputs at consecutive positions run
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="0x12"):  # Error::InvalidArgument, its reason in the kernel's log
        method.execute(args + [torch.tensor([4, 5, 7])])
    assert "llmpipe::gated_delta_rule: positions must be consecutive" in capfd.readouterr().err


C, K = 24, 4


def conv_inputs(seed: int = 3, T: int = 40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, C, generator=g), torch.randn(C, K, generator=g), torch.randn(C, generator=g)


@pytest.mark.parametrize("activation", [0, 1], ids=["none", "silu"])
@pytest.mark.parametrize("piece", [1, 7, 40], ids=lambda p: f"piece{p}")
def test_causal_conv_in_pieces_equals_one_conv(piece, activation):
    """The state (the last K-1 inputs) carries a sequence cut anywhere: HF's causal conv (a padded depthwise Conv1d)
    over the whole of it; a step at position 0 forgets what the state held."""
    x, w, b = conv_inputs()
    want = F.conv1d(x.transpose(1, 2), w[:, None], b, padding=K - 1, groups=C)[..., :x.shape[1]].transpose(1, 2)
    if activation:
        want = F.silu(want)
    state = torch.full((K - 1, C), 5.0)
    got = torch.cat([causal_conv_ref(x[:, p:p + piece], w, b, state, torch.arange(p, min(40, p + piece)), activation)
                     for p in range(0, 40, piece)], 1)
    assert (got - want).abs().max().item() < 1e-5
    assert torch.equal(state, x[0, -(K - 1):])


class _Conv(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("b", b)
        self.register_buffer("state", torch.zeros(K - 1, C))

    def forward(self, x, position):
        return torch.ops.llmpipe.causal_conv(x, self.w, self.b, self.state, position, 1)


def test_causal_conv_kernel_equals_its_twin_across_steps(tmp_path):
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.runtime import Runtime
    x, w, b = conv_inputs(T=60)
    n = torch.export.Dim("n", min=1, max=64)
    with torch.no_grad():
        ep = torch.export.export(_Conv(w, b), (x[:, :3], torch.arange(3)), dynamic_shapes=({1: n}, {0: n}))
    program = to_edge(ep).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True))
    (tmp_path / "conv.pte").write_bytes(program.buffer)
    load_native_kernels()
    method = Runtime.get().load_program(str(tmp_path / "conv.pte")).load_method("forward")
    state = torch.zeros(K - 1, C)
    pos = 0
    for step in [5, 1, 1, 20, 3, 30, 4, 9]:  # 60 positions, then a new sequence: the state is forgotten at 0
        if pos == 60:
            assert state.abs().sum() > 0
            pos = 0
        xs, positions = x[:, pos:pos + step].contiguous(), torch.arange(pos, pos + step)
        got = method.execute([xs, positions])[0]
        want = causal_conv_ref(xs, w, b, state, positions, 1)
        assert (got - want).abs().max().item() < 1e-5, (pos, step)
        pos += step
