"""XNNPACK computes every GELU as the erf form (its serializer drops `approximate`): the tanh GELU of Gemma's MLPs
must stay outside the delegate (pipeline/backends/xnnpack/weight_only.py ExactGeluConfig)."""
from __future__ import annotations

import torch
from torch import nn


class Gelus(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(x, approximate="tanh") + nn.functional.gelu(x * 0.5)


def _run(partitioner, x):
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    ep = torch.export.export(Gelus(), (x,), strict=True)
    prog = to_edge_transform_and_lower(ep, partitioner=[partitioner]).to_executorch()
    method = Runtime.get().load_program(prog.buffer).load_method("forward")
    delegated = sum(1 for n in prog.exported_program().graph.nodes if n.op == "call_function"
                    and "gelu" in str(n.target))
    return method.execute([x])[0], delegated


def test_tanh_gelu_stays_out_of_the_delegate_and_is_exact():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from pipeline.backends.xnnpack.weight_only import partitioner
    x = torch.linspace(-4, 4, 256).reshape(1, 256)
    want = Gelus()(x)
    ours, outside = _run(partitioner(), x)
    assert outside == 1  # the tanh one; the erf one is delegated
    assert (ours - want).abs().max().item() < 1e-6
    stock, outside = _run(XnnpackPartitioner(), x)
    assert outside == 0 and (stock - want).abs().max().item() > 1e-4  # the stock partitioner computes erf
