"""int8 K/V rows (pipeline/model/kv/quant.py), the Python twin of the C++ caches' rows: the layout, the rounding bound,
and the caches that store them (the C++ kernels against it: tests/native/test_offgraph_native.py)."""
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


def test_the_python_cache_stores_int8_rows_across_ring_wraps():
    """The eager off-graph cache: a ring of window 5 + chunk 4 - 1 slots wrapped twice, gathering what it stored."""
    spec = LayerSpec(2, 40, 24, 5)
    cache = OffgraphCache([spec], capacity=64, max_write=4, initial_capacity=4, dtype=torch.int8)
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
            assert torch.allclose(K[:, j], quant.decode(quant.encode(last[p][0], torch.int8)))
            assert torch.allclose(V[:, j], quant.decode(quant.encode(last[p][1], torch.int8)))
        pos += n
    assert cache.layers[0].k.shape[-1] == 40 + 8 and cache.nbytes() == 2 * 8 * (48 + 28)
