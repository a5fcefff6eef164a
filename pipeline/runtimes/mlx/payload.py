"""The MLX delegate's payload, decoded: tensor slots, value slots and instruction chains (schema.fbs in the
wheel), plus the dtype conversions between ExecuTorch, torch and mlx."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.abi import SCALAR_TYPES
from pipeline.runtimes.base import Unsupported


class UnsupportedInstruction(Unsupported):
    """An instruction (or dtype, or outer-program kernel) the interpreter has no handler for."""


def _mx():
    import mlx.core as mx
    return mx


def _torch_dtype(code: int) -> torch.dtype:
    if code not in SCALAR_TYPES:
        raise UnsupportedInstruction(f"ScalarType {code}")
    return SCALAR_TYPES[code]


def mx_dtype(code: int):
    name = str(_torch_dtype(code)).removeprefix("torch.")
    return getattr(_mx(), "bool_" if name == "bool" else name)


def np_dtype(code: int):
    t = _torch_dtype(code)
    # numpy has no bfloat16: its bits travel as uint16 and are viewed back on the other side
    return np.uint16 if t == torch.bfloat16 else torch.empty((), dtype=t).numpy().dtype


def to_mx(t: torch.Tensor):
    mx = _mx()
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def to_torch(a) -> torch.Tensor:
    mx = _mx()
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))

@dataclass
class Meta:
    shape: list            # ints; None for a dynamic dim
    scalar_type: int


@dataclass
class Graph:
    """One MLX delegate payload, decoded."""
    num_constants: int
    num_values: int
    chains: list           # [[instruction dict]]
    main_chain: int
    init_chain: int
    inputs: list           # [(slot idx, slot type)]
    outputs: list
    mutable: list
    names: dict            # tid -> name (constants and mutable buffers)
    meta: dict             # tid -> Meta

    def ops(self) -> list[str]:
        return [ins["op_name"] for chain in self.chains for ins in chain]


def decode_payload(raw: bytes) -> Graph:
    from pipeline.backends.mlx.schema import ensure
    ensure()
    from executorch.backends.mlx.pte_inspector import (MLX_HEADER_LENGTH, MLXHeader, _get_fb_graph,
                                                       _parse_instructions)
    header = MLXHeader.from_bytes(raw)
    if not header.is_valid():
        raise ValueError(f"not an MLX delegate payload (magic {header.magic!r})")
    g = _get_fb_graph(raw[MLX_HEADER_LENGTH:header.data_segment_offset])
    chains = []
    for chain in _parse_instructions(g):
        for ins in chain["instructions"]:
            if "error" in ins or "parse_error" in ins:
                raise ValueError(f"instruction {ins.get('instr_idx')} cannot be decoded: {ins}")
        chains.append(chain["instructions"])
    slots = lambda n, get: [(get(i).Idx(), get(i).SlotType()) for i in range(n)]  # noqa: E731
    meta = {}
    for i in range(g.TensorMetaLength()):
        tm = g.TensorMeta(i)
        if tm is None:
            continue
        dims = [tm.Shape(j).Value() for j in range(tm.ShapeLength())]
        meta[i] = Meta([d if d >= 0 else None for d in dims], tm.ScalarType())
    names = {}
    for i in range(g.NamedSlotsLength()):
        ns = g.NamedSlots(i)
        if ns.Slot().SlotType() == 0:
            names[ns.Slot().Idx()] = ns.Name().decode()
    return Graph(num_constants=g.NumConstantTensors(), num_values=g.NumValues(), chains=chains,
                 main_chain=g.MainChainIdx(), init_chain=g.InitChainIdx(),
                 inputs=slots(g.InputMapLength(), g.InputMap), outputs=slots(g.OutputMapLength(), g.OutputMap),
                 mutable=slots(g.MutableBufferMapLength(), g.MutableBufferMap), names=names, meta=meta)


def tid(ref) -> int:
    """A decoded tensor reference's id (tid lists decode as "tid N")."""
    if isinstance(ref, str):
        return int(ref.split()[1])
    return int(ref["tid"])
