"""pipeline/backends/xnnpack/numerics.py: torch emulation of XNNPACK's dynamically quantized linears.

- the arithmetic: a single-rounding fma, the per-row parameters against a scalar float32 re-derivation of the C;
- a wide linear (4-bit groups, 4-bit and 8-bit per channel), lowered alone: the reference's output bit for bit;
- on tiny random Llamas built through the pipeline (8da4w: qd8-f32-qb4w; 8da8w per channel: qd8-f32-qc8w), every
  linear lowered alone with the pipeline's partitioner and run on the activations the model feeds it: the
  reference's output bit for bit, torchao's eager linear not;
- end to end (teacher-forced logits of the built 8da4w program): the reference is clearly closer than torchao's
  module, though not identical: the float ops outside the linears (XNNPACK's rsqrt, sigmoid, sin/cos, softmax, bmm)
  differ from eager in the last bits and flip an int8 rounding now and then. For 8da8w end to end there is no margin
  to test: torchao's fp32 per-channel emulation is already XNNPACK's up to last bits, below that float-op floor.

The emulation follows the x86 AVX-512 VNNI kernels (unsigned qdu8 activations). On a CPU whose XNNPACK picks other
kernels (AVX2, AMX, Arm) the sums and epilogues differ in the last bits, so there the linears are held to a few ulps
of the reference instead of bit for bit (`_same`).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.backends.xnnpack.numerics import dynamic_weight, fma32, follows_this_cpu, reference, row_qparams
from pipeline.runtimes import open_program
from pipeline.runtimes.base import run_sequence
from tests.helpers import build, stage_path

RECIPE = "tiny_llama_xnnpack_8da4w"
STAGES = ("download", "wrap", "quantize", "export", "lower")
SCHEMES = {"8da4w": (), "8da8w": ("quantize.linear=8da8w", "quantize.linear_group_size=0")}
SEEDS, TOKENS, PREFILL = range(4), 40, 8


@pytest.fixture(scope="module")
def built():
    """The scheme's run manifest (built once per module, shared through the stage cache)."""
    runs = {}

    def get(scheme: str) -> dict:
        if scheme not in runs:
            runs[scheme] = build(RECIPE, *SCHEMES[scheme], stages=STAGES)
        return runs[scheme]
    return get


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool | None = None) -> bool:
    """Bit for bit where this CPU runs the kernels the emulation follows; elsewhere within last-bit differences of
    the fp32 epilogue (1e-5 of the output's scale: an order-of-summation difference, never a wrong int)."""
    if follows_this_cpu() if exact is None else exact:
        return torch.equal(got, want)
    return (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _eager(manifest: dict) -> nn.Module:
    return torch.load(stage_path(manifest, "quantize") / "module.pt", weights_only=False)


# --- the arithmetic ------------------------------------------------------------------------------------------

def test_fma32_rounds_once():
    """641 * 6700417 = 2^32 + 1: 1 + 641 * (6700417 * 2^-56) is just above the fp32 midpoint 1 + 2^-24, which a
    float64 sum rounds onto (then half-to-even gives 1); one rounding gives 1 + 2^-23."""
    a, b, c = torch.tensor([641.0]), torch.tensor([6700417 * 2.0 ** -56]), torch.tensor([1.0])
    assert (a.double() * b.double() + c.double()).float().item() == 1.0
    assert fma32(a, b, c).item() == 1 + 2.0 ** -23


def test_the_native_fma_chain_gives_the_numpy_bits():
    """fma32_chain in C (fmaf) and in numpy (float64 rounded to odd): the same bits, on sums that round."""
    from pipeline.backends.xnnpack.numerics import _native_chain, fma32_chain
    assert _native_chain() is not None  # CI builds native/: verify uses the C chain
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randint(-2 ** 20, 2 ** 20, (18, 3, 257), generator=g).float(),
              (torch.rand(18, 257, generator=g).to(torch.bfloat16).float() / 16), torch.randn(3, 257, generator=g)),
             # scales spread over 40 binades: products far below the running sum, where a double sum rounds
             (torch.randint(-4096, 4096, (4, 1, 4096), generator=g).float(),
              torch.ldexp(torch.ones(4, 4096), torch.randint(-40, 0, (4, 4096), generator=g)),
              torch.randn(1, 4096, generator=g) * 1024)]
    for terms, scales, start in cases:
        assert torch.equal(fma32_chain(terms, scales, start), fma32_chain(terms, scales, start, native=False))
    a, b, c = torch.tensor([[[641.0]]]), torch.tensor([[6700417 * 2.0 ** -56]]), torch.tensor([[1.0]])
    assert fma32_chain(a, b, c).item() == 1 + 2.0 ** -23


def _c_params(row: np.ndarray) -> tuple[np.float32, np.float32, int]:
    """src/xnnpack/quantization.h, one row, in numpy float32 scalars (IEEE division, no reciprocal)."""
    f = np.float32
    rmin, rmax = min(f(0), f(row.min())), max(f(0), f(row.max()))
    m = f(1) if rmin == rmax else f(255) / f(rmax - rmin)
    lo, hi = f(rmin * m), f(rmax * m)
    zp = f(-128) - lo if f(f(-128) + lo) + f(f(127) + hi) > 0 else f(127) - hi
    zp = int(np.rint(min(max(zp, f(-128)), f(127))))
    return m, f(1) / m, zp + 128


def test_row_parameters_follow_the_c_arithmetic():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(200, 96, generator=g) * torch.rand(200, 1, generator=g) * 8 + torch.randn(200, 1, generator=g)
    rows[0], rows[1], rows[2] = 0, rows[1].abs(), -rows[2].abs()   # constant, all positive, all negative
    mult, dq, zp = row_qparams(rows)
    for i, row in enumerate(rows.numpy()):
        m, d, z = _c_params(row)
        assert (mult[i].item(), dq[i].item(), zp[i].item()) == (float(m), float(d), z), i


# --- each linear, on the activations the model feeds it ----------------------------------------------------

class _Linears(nn.Module):
    def __init__(self, linears):
        super().__init__()
        self.linears = nn.ModuleList(linears)

    def forward(self, *xs):
        per = len(xs) // len(self.linears)   # each linear takes `per` inputs in a row
        return tuple(self.linears[i // per](x) for i, x in enumerate(xs))


def _inputs(module: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each dynamic linear's input in a 16-token prefill and the decode step after it (eager run)."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda m, args, out, n=n: seen.setdefault(n, []).append(args[0].clone()))
             for n, m in module.model.named_modules() if dynamic_weight(m) is not None]
    ids = torch.randint(3, 512, (17,), generator=torch.Generator().manual_seed(0)).tolist()
    run_sequence(module, ids[:16], 16)
    run_sequence(module, ids[16:], 1, start=16)
    for h in hooks:
        h.remove()
    return seen


def _lowered(linears: list[nn.Module], xs: list[torch.Tensor], tmp_path) -> list[torch.Tensor]:
    """The linears lowered as the pipeline lowers them (its XNNPACK partitioner), run in ExecuTorch."""
    from executorch.exir import to_edge_transform_and_lower
    from pipeline.backends.xnnpack.weight_only import partitioner
    from pipeline.runtimes import executorch as et
    ep = torch.export.export(_Linears(linears).eval(), tuple(xs), strict=True)
    program = to_edge_transform_and_lower(ep, partitioner=[partitioner()]).to_executorch()
    path = tmp_path / "linears.pte"
    path.write_bytes(program.buffer)
    return et.load(path).execute(list(xs))


@pytest.mark.parametrize("bits,group,bias", [(4, 32, False), (4, 0, True), (8, 0, True)])
def test_a_wide_linear_is_bit_exact(bits, group, bias, tmp_path):
    """1024 inputs, 64 rows of uneven ranges: wide enough that the qdu8 (not qd8) fp32 epilogue of the 4-bit kernel
    shows (a signed emulation misses ~1 output in 1000 by an ulp)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(1024, 256, bias=bias))
    dtype, granularity = torch.int4 if bits == 4 else torch.int8, PerGroup(group) if group else PerAxis(0)
    quantize_(linear, Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=granularity))
    x = torch.randn(1, 64, 1024) * torch.rand(1, 64, 1) * 4 + torch.randn(1, 64, 1)
    got = _lowered([linear[0]], [x], tmp_path)[0]
    with torch.no_grad():
        assert _same(got, reference(linear)(x))
        if follows_this_cpu() and group:
            # the other activation form misses by an ulp now and then: the strict check sees it, the loose one not
            other = reference(linear, unsigned=False)(x)
            assert not _same(got, other) and _same(got, other, exact=False)


# 8da8w (the per-channel variant of the same kernels) in the slow tier
@pytest.mark.parametrize("scheme", [pytest.param(s, marks=pytest.mark.slow) if s == "8da8w" else s for s in SCHEMES])
def test_every_linear_is_bit_exact(built, scheme, tmp_path):
    eager = _eager(built(scheme))
    ref = reference(eager)
    seen = _inputs(eager)
    names = sorted(seen)
    linears = dict(eager.model.named_modules())
    ref_linears = dict(ref.model.named_modules())
    xs = [x for n in names for x in seen[n][:2]]
    got = _lowered([linears[n] for n in names], xs, tmp_path)
    with torch.no_grad():
        want = [ref_linears[n](x) for n in names for x in seen[n][:2]]
        torchao = [linears[n](x) for n in names for x in seen[n][:2]]
    assert len(got) == len(want) == 2 * len(names)
    mismatched = [f"{names[i // 2]} ({'prefill' if i % 2 == 0 else 'decode'})"
                  for i, (g, w) in enumerate(zip(got, want)) if not _same(g, w)]
    assert not mismatched, mismatched
    # torchao's emulation is not XNNPACK's: fp32 group scales for 8da4w (an error of ~1e-3 and up), float
    # summation order (and now and then an activation rounded the other way) for 8da8w
    far = max((g - t).abs().max().item() for g, t in zip(got, torchao))
    assert far > (1e-3 if scheme == "8da4w" else 0.0), far


# --- end to end ----------------------------------------------------------------------------------------------

def _teacher_forced(module, ids: list[int], chunk: int) -> torch.Tensor:
    steps = [run_sequence(module, ids[:PREFILL], chunk)]
    steps += [run_sequence(module, [t], 1, start=PREFILL + i) for i, t in enumerate(ids[PREFILL:])]
    return torch.stack(steps)


def _gap(ref: torch.Tensor, got: torch.Tensor) -> dict:
    kld = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return {"kld": kld.mean().item(), "mean": (ref - got).abs().mean().item(), "max": (ref - got).abs().max().item()}


def test_the_8da4w_program_is_closer_to_the_reference_than_to_torchao(built):
    """Measured (4 sequences x 33 steps): KLD 8.5e-5 vs 1.6e-4 (0.54x), mean |dlogit| 0.0085 vs 0.014 (0.61x)."""
    m = built("8da4w")
    eager = _eager(m)
    ref, program = reference(eager), open_program(stage_path(m, "lower"))
    chunk = m["config"]["export"]["prefill_chunk"]
    runs = {"program": [], "torchao": [], "reference": []}
    for seed in SEEDS:
        ids = torch.randint(3, 512, (TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()
        program.reset()
        for name, module in (("program", program), ("torchao", eager), ("reference", ref)):
            runs[name].append(_teacher_forced(module, ids, chunk))
    got = torch.cat(runs["program"])
    torchao, ours = _gap(torch.cat(runs["torchao"]), got), _gap(torch.cat(runs["reference"]), got)
    assert ours["kld"] < 0.75 * torchao["kld"], (ours, torchao)
    assert ours["mean"] < 0.75 * torchao["mean"], (ours, torchao)


def test_the_native_4bit_gemm_gives_the_torch_paths_bits():
    """llmpipe_qb4w_gemm (packed 4-bit weights, AVX-512 VNNI) against the torch path (fp32 dots, then the chain):
    the same bits, on columns that are not a multiple of 16, a bias, a per-channel group wide enough that its dots
    round to fp32, and weights at the ends of the nibble range."""
    from pipeline.backends.xnnpack.numerics import QB4WLinear, _native_qb4w
    if _native_qb4w() is None:
        pytest.skip("no native 4-bit GEMM here (a CPU without AVX-512 VNNI, or no kernel library): the torch path only")
    g = torch.Generator().manual_seed(0)
    for n, k, group, rows in [(37, 64, 16, 3), (300, 640, 32, 9), (24, 8192, 8192, 2)]:
        qdata = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        if group == 32:  # only -8 and 7: the packing's offset and both nibbles at their ends
            qdata = torch.where(qdata < 0, -8, 7).to(torch.int8)
        scale = torch.rand(n, k // group, generator=g) * 0.01
        bias = torch.randn(n, generator=g)
        x = torch.randn(rows, k, generator=g) * 3
        native, plain = QB4WLinear(qdata, scale, bias), QB4WLinear(qdata, scale, bias, native=False)
        assert native.native and not plain.native
        assert torch.equal(native(x), plain(x)), (n, k, group)
