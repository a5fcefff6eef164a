"""Where things are in a .pte: the extended header, the XNNPACK delegate graphs and their tensor dims.

A minimal FlatBuffers reader (field numbers of ExecuTorch's program.fbs and the XNNPACK runtime_schema.fbs),
used by test_fuzz.py to aim damage and to recognise the byte ranges of the documented loader crashes
(native/README.md, "Known loader crashes"), and by repro_loader_crash.py.
"""
from __future__ import annotations

import struct


def _u(fmt: str, b: bytes, pos: int):
    return struct.unpack_from(fmt, b, pos)[0]


class Table:
    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos

    @classmethod
    def root(cls, buf: bytes) -> "Table":
        return cls(buf, _u("<I", buf, 0))

    def field(self, i: int) -> int | None:
        vt = self.pos - _u("<i", self.buf, self.pos)
        if 4 + 2 * i + 2 > _u("<H", self.buf, vt):
            return None
        off = _u("<H", self.buf, vt + 4 + 2 * i)
        return self.pos + off if off else None

    def scalar(self, i: int, fmt: str, default=0):
        p = self.field(i)
        return default if p is None else _u(fmt, self.buf, p)

    def table(self, i: int) -> "Table | None":
        p = self.field(i)
        return None if p is None else Table(self.buf, p + _u("<I", self.buf, p))

    def vector(self, i: int) -> tuple[int, int] | None:
        """(length, position of element 0)."""
        p = self.field(i)
        if p is None:
            return None
        v = p + _u("<I", self.buf, p)
        return _u("<I", self.buf, v), v + 4

    def element(self, vec: tuple[int, int], k: int) -> "Table":
        p = vec[1] + 4 * k
        return Table(self.buf, p + _u("<I", self.buf, p))

    def string(self, i: int) -> str | None:
        v = self.vector(i)
        return None if v is None else self.buf[v[1]:v[1] + v[0]].decode("utf-8", "replace")


def layout(data: bytes) -> tuple[int, int]:
    """(flatbuffer size, segment base) from the extended header "eh00" at byte 8."""
    assert data[4:8] == b"ET12" and data[8:12] == b"eh00", "not an ExecuTorch program with an extended header"
    _, program_size, segment_base = struct.unpack_from("<IQQ", data, 12)
    return program_size, segment_base


def delegate_blobs(data: bytes, backend: str = "XnnpackBackend") -> list[tuple[int, int]]:
    """(start, end) in the file of every delegate payload of `backend` (inline or in a segment)."""
    _, segment_base = layout(data)
    program = Table.root(data)
    plans = program.vector(1)
    out = []
    for p in range(plans[0]):
        plan = program.element(plans, p)
        delegates = plan.vector(7)
        for k in range(delegates[0] if delegates else 0):
            d = plan.element(delegates, k)
            if d.string(0) != backend:
                continue
            ref = d.table(1)
            location, index = ref.scalar(0, "<B"), ref.scalar(1, "<I")
            if location == 0:  # inline: backend_delegate_data[index].data
                v = program.element(program.vector(3), index).vector(0)
                out.append((v[1], v[1] + v[0]))
            else:
                seg = program.element(program.vector(4), index)
                start = segment_base + seg.scalar(0, "<Q")
                out.append((start, start + seg.scalar(1, "<Q")))
    return sorted(set(out))


def call_args(data: bytes) -> list[tuple[int, int, str]]:
    """(file offset of the length word, length, operator or "delegate") of the args vector of every
    KernelCall and DelegateCall of every method."""
    program = Table.root(data)
    plans = program.vector(1)
    out = []
    for p in range(plans[0]):
        plan = program.element(plans, p)
        ops = plan.vector(6)
        names = [plan.element(ops, k).string(0) for k in range(ops[0])] if ops else []
        chains = plan.vector(5)
        for c in range(chains[0] if chains else 0):
            chain = plan.element(chains, c)
            instructions = chain.vector(2)
            for k in range(instructions[0] if instructions else 0):
                instr = chain.element(instructions, k)
                kind = instr.scalar(0, "<B")
                if kind not in (1, 2):  # KernelCall, DelegateCall
                    continue
                call = instr.table(1)
                args = call.vector(1)
                if args:
                    name = names[call.scalar(0, "<i")] if kind == 1 else "delegate"
                    out.append((args[1] - 4, args[0], name))
    return out


def xnnpack_graphs(data: bytes) -> list[tuple[int, int]]:
    """(start, end) in the file of each XNNPACK graph flatbuffer (after its "XH00" header)."""
    out = []
    for start, end in delegate_blobs(data):
        blob = data[start:end]
        if blob[4:8] == b"XH00":
            fb_off, fb_size = struct.unpack_from("<II", blob, 10)
            out.append((start + fb_off, start + fb_off + fb_size))
    return out


def xnnpack_values(data: bytes):
    """Every XNNPACK tensor value: (graph start in the file, graph bytes, index, tensor Table)."""
    for start, end in xnnpack_graphs(data):
        g = data[start:end]
        graph = Table.root(g)
        xvalues = graph.vector(2)
        for j in range(xvalues[0] if xvalues else 0):
            xv = graph.element(xvalues, j)
            val = xv.table(1)
            tensor = (val.table(0) if xv.scalar(0, "<B") == 2 else val) if val else None  # quantized: tensor first
            if tensor is not None:
                yield start, g, j, tensor


def activation_dims_ranges(data: bytes) -> list[tuple[int, int]]:
    """(start, end) in the file of the `dims` vectors (length word and entries) of the XNNPACK tensor values
    that are not constants: the byte range of the documented loader crash (native/README.md, "Known loader
    crashes": XNNPACK plans its workspace from these dims unchecked). Constants' dims are checked by the
    runner against their data."""
    out = []
    for start, g, _, tensor in xnnpack_values(data):
        dims = tensor.vector(2)
        if dims and tensor.scalar(3, "<I") == 0:  # constant_buffer_idx 0: not a constant
            out.append((start + dims[1] - 4, start + dims[1] + 4 * dims[0]))
    return sorted(out)
