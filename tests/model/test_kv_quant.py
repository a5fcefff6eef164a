"""int8 and int4 K/V rows (pipeline/model/kv/quant.py), the Python twin of the C++ caches' rows: the layout, the
rounding bound, the rotation, and the caches that store them (the C++ kernels against it:
tests/native/test_offgraph_native.py)."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.kv import quant
from pipeline.model.kv.layout import LayerSpec
from pipeline.model.kv.runtime_cache import OffgraphCache


@pytest.mark.parametrize("dim", [4, 16, 32, 40, 64, 80, 128, 256])
def test_rows_round_within_half_a_step_of_their_group(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 5, dim, generator=g)
    x[..., 0] = 40.0  # an outlier channel: it sets its own group's scale only
    rows = quant.encode(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape[-1] == quant.row_width(torch.int8, dim)
    assert quant.stored_dim(rows) == dim
    y = quant.decode(rows)
    for g0 in range(0, dim, quant.GROUP):
        group = slice(g0, min(dim, g0 + quant.GROUP))
        step = x[..., group].abs().amax(-1, keepdim=True) / 127
        assert ((y[..., group] - x[..., group]).abs() <= step / 2 + 1e-6).all()
    if dim > quant.GROUP:  # the groups past the outlier's keep a fine step
        assert (y[..., quant.GROUP:] - x[..., quant.GROUP:]).abs().max() < 0.05


def test_layout_scales_first_last_group_first():
    x = torch.cat([torch.full((32,), 1.27), torch.full((8,), -2.54)])  # scales 0.01 and 0.02
    rows = quant.encode(x, torch.int8)
    scales = rows[:8].view(torch.float32)
    assert scales.tolist() == pytest.approx([0.02, 0.01])
    assert rows[8:].tolist() == [127] * 32 + [-127] * 8


def test_zero_rows_and_float_storage_pass_through():
    rows = quant.encode(torch.zeros(2, 64), torch.int8)
    assert quant.decode(rows).abs().max() == 0
    x = torch.randn(2, 8)
    assert quant.encode(x, torch.float16).dtype == torch.float16 and quant.row_width(torch.float16, 8) == 8
    assert quant.decode(x) is x
    with pytest.raises(ValueError, match="no int8 K/V row is 4 elements wide"):
        quant.stored_dim(torch.zeros(1, 4, dtype=torch.int8))


@pytest.mark.parametrize("dim", [2, 8, 40, 64, 96, 256])
def test_the_rotation_is_orthonormal_and_its_own_inverse(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(7, dim, generator=g, dtype=torch.float64).float()
    y = quant.hadamard(x)
    assert torch.allclose(quant.hadamard(y), x, atol=1e-6)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    block = dim & -dim  # rotated within blocks of the largest power of two dividing the dim
    h = torch.tensor([[1.0]], dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    want = (x.double().unflatten(-1, (dim // block, block)) @ h.T / block ** 0.5).flatten(-2)
    assert torch.allclose(y.double(), want, atol=1e-5)


@pytest.mark.parametrize("dim", [8, 40, 64, 256])
def test_int4_rows_round_within_half_a_step_in_the_rotated_basis(dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 5, dim, generator=g)
    x[..., 0] = 40.0  # an outlier channel: the rotation spreads it over the block
    rows = quant.encode(x, quant.INT4)
    width = dim // 2 + 2 * -(-dim // quant.GROUP)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == quant.row_width(quant.INT4, dim) == width
    assert quant.stored_dim(rows) == dim
    r, back = quant.hadamard(x), quant.hadamard(quant.decode(rows))  # both in the rotated basis
    for g0 in range(0, dim, quant.GROUP):
        group = slice(g0, min(dim, g0 + quant.GROUP))
        step = r[..., group].abs().amax(-1, keepdim=True) / 8  # the largest value lands on -8 steps
        err = (back[..., group] - r[..., group]).abs()
        # within half a step, but for values on the other side past 7 steps, which clip at 7
        allowed = torch.maximum(step / 2, r[..., group].abs() - 7 * step)
        assert (err <= allowed * (1 + 1e-3) + 1e-5).all()
    if dim >= 64:  # rotated, the outlier no longer costs the other channels 4 bits: ~10 % of the row's norm
        assert ((quant.decode(rows) - x).norm(dim=-1) / x.norm(dim=-1)).max() < 0.15


def test_int4_layout_fp16_scales_first_then_nibbles_low_first():
    x = torch.zeros(64)
    x[0], x[1] = 6.0, 2.0  # rotated: (6 + 2) / 8 and (6 - 2) / 8 in turn (the first two Hadamard rows)
    rows = quant.encode(x, quant.INT4)
    assert rows.shape[-1] == 32 + 4
    scales = rows[:4].view(torch.float16).float()
    assert scales.tolist() == [-1 / 8, -1 / 8]  # the largest value (1.0, the first of equals) / -8, fp16
    assert rows[4:].tolist() == [0x40] * 32  # -8 + 8 = 0 in the low nibbles, -4 + 8 = 4 in the high ones
    assert torch.allclose(quant.decode(rows), x, atol=1e-5)
    odd = quant.encode(torch.ones(3), quant.INT4)  # an odd row: block 1 (no rotation), its last high nibble zero
    assert odd.shape[-1] == 2 + 2 and odd[-1].item() >> 4 == 8


def test_zero_int4_rows_and_unknown_widths():
    assert quant.decode(quant.encode(torch.zeros(2, 64), quant.INT4)).abs().max() == 0
    with pytest.raises(ValueError, match="no int4 K/V row is 1 elements wide"):
        quant.stored_dim(torch.zeros(1, 1, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.int8, quant.INT4], ids=["int8", "int4"])
def test_the_python_cache_stores_quantized_rows_across_ring_wraps(dtype):
    """The eager off-graph cache: a ring of window 5 + chunk 4 - 1 slots wrapped twice, gathering what it stored."""
    spec = LayerSpec(2, 40, 24, 5)
    cache = OffgraphCache([spec], capacity=64, max_write=4, initial_capacity=4, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    pos, last = 0, {}
    for n in [4, 3, 4, 4, 2, 4]:
        k, v = torch.randn(2, n, 40, generator=g), torch.randn(2, n, 24, generator=g)
        plan = cache.plan(0, pos, n)
        cache.write(plan, k, v)
        cache.commit(pos, n)
        for i in range(n):
            last[pos + i] = (k[:, i], v[:, i])
        K, V = cache.gather(plan)
        for j, p in enumerate(range(plan.base, plan.end)):
            assert torch.equal(K[:, j], quant.decode(quant.encode(last[p][0], dtype)))
            assert torch.equal(V[:, j], quant.decode(quant.encode(last[p][1], dtype)))
        pos += n
    k_row, v_row = (40 + 8, 24 + 4) if dtype == torch.int8 else (20 + 4, 12 + 2)
    assert cache.layers[0].k.shape[-1] == k_row and cache.nbytes() == 2 * 8 * (k_row + v_row)
