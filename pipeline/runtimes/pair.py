"""The transformers exporter's two-program layout (prefill.pte + decode.pte, the KV cache as program input and
output) in a runtime, behind the runner interface of pipeline/runtimes/base.py.

`PrefillDecodeModule(folder, runtime)(tokens Long[1, T], positions Long[T]) -> logits [1, T, V]`, like a
RunnerProgram, so verify's checks run on it unchanged:
- a call at position 0 starts a sequence: prefill.pte, which allocates the KV cache itself (its cache input is
  only each layer's write position);
- every later call runs decode.pte (exported with a dynamic token count, so it takes continuation chunks of a
  chunked prefill and single decode steps alike), fed the cache the previous call returned, a boolean mask
  [1, 1, T, context] (query row i sees the slots <= its position) and each layer's write position
  (`cumulative_length`) set to positions[0], so a rerun from an earlier position overwrites, as the native
  static cache does.
Which flat program input/output is which comes from the pytree specs the exporter recorded in export.json.

`DynamicCacheModule(folder, runtime)`: the same interface over the layout of the exporter's mlx backend (it refuses a
StaticCache), a `DynamicCache` that grows every call: prefill.pte takes no cache and returns each layer's K/V
[1, Hkv, T, D]; decode.pte takes the K/V so far (a dynamic length, the positions before the call) and returns them
with the new tokens appended (the causal mask is built in the graph from the cache length). A call at an earlier
position crops the cache to it first (DynamicCache.crop), so a rerun overwrites, as the native static cache does.
There is no MLX runtime on Linux: the `mlx` runtime executes each program's MLX delegate payload with our
interpreter; `executorch` is the ExecuTorch runtime (a Mac with MLXBackend registered). `open_pair(folder, runtime)`
picks the class from the cache type recorded in export.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.abi import INT64

# the inputs each program may take, beside the cache; anything else is a layout this runtime does not know
KNOWN_INPUTS = {"prefill": {"input_ids", "position_ids", "past_key_values"},
                "decode": {"input_ids", "attention_mask", "position_ids", "past_key_values"}}


class LayoutError(RuntimeError):
    pass


class _Program:
    """One exported program: its `forward` method and where each named input/output sits in the flat lists."""

    def __init__(self, folder: Path, name: str, entry: dict, runtime):
        from transformers.exporters.metadata import load_treespec

        md = entry["metadata"]
        if md.get("in_constants"):
            raise LayoutError(f"{name}: traced constant inputs {md['in_constants']} are not supported")
        self.program = runtime.load(folder / entry["file"])  # a runtime refuses what it cannot run, here
        in_spec, out_spec = load_treespec(md["in_spec"]), load_treespec(md["out_spec"])
        _, kwargs = in_spec.children()  # forward(*(), **kwargs)
        self.inputs, self.input_types, i = {}, {}, 0
        for key, child in zip(_keys(kwargs), kwargs.children()):
            self.inputs[key] = slice(i, i + child.num_leaves)
            self.input_types[key] = child.type
            i += child.num_leaves
        self.n_inputs = i
        unknown = set(self.inputs) - KNOWN_INPUTS[name]
        if unknown or "input_ids" not in self.inputs or "past_key_values" not in self.inputs:
            raise LayoutError(f"{name}.pte takes {sorted(self.inputs)}; this runtime runs {sorted(KNOWN_INPUTS[name])}")
        # the model's outputs are the last leaves; mutated inputs (the cache written in place) come before them
        self.n_outputs = out_spec.num_leaves
        self.outputs, i = {}, 0
        for key, child in zip(_keys(out_spec), out_spec.children()):
            self.outputs[key] = slice(i, i + child.num_leaves)
            i += child.num_leaves
        if set(self.outputs) != {"logits", "past_key_values"}:
            raise LayoutError(f"{name}.pte returns {sorted(self.outputs)}; expected logits and past_key_values")
        self.input_meta = self.program.input_meta()  # [(sizes, ScalarType code)]
        if len(self.input_meta) != self.n_inputs:
            raise LayoutError(f"{name}.pte takes {len(self.input_meta)} inputs; export.json's spec has {self.n_inputs}")

    def cache_type(self) -> str:
        t = self.input_types.get("past_key_values")
        return getattr(t, "__name__", str(t))

    def run(self, named: dict) -> dict:
        feed = [None] * self.n_inputs
        for key, s in self.inputs.items():
            value = named[key]
            feed[s] = value if isinstance(value, list) else [value]
        out = self.program.execute(feed)
        tail = out[len(out) - self.n_outputs:]
        return {key: tail[s] for key, s in self.outputs.items()}


def _keys(spec) -> list[str]:
    ctx = spec.context
    return json.loads(ctx) if isinstance(ctx, str) else list(ctx)


def _is_position(info) -> bool:
    # a layer's `cumulative_length`: the only 0-d int64 leaf of a StaticCache
    sizes, dtype = info
    return tuple(sizes) == () and dtype == INT64


class _Pair:
    """The two programs of an exporter folder, in one runtime; the KV cache between calls is the layout's."""

    def __init__(self, folder: Path, runtime):
        folder = Path(folder)
        manifest = json.loads((folder / "export.json").read_text())
        missing = [n for n in KNOWN_INPUTS if n not in manifest["components"]]
        if missing:
            raise LayoutError(f"{folder}/export.json has components {sorted(manifest['components'])}, "
                              f"missing {missing}")
        self.folder = folder
        self.prefill = _Program(folder, "prefill", manifest["components"]["prefill"], runtime)
        self.decode = _Program(folder, "decode", manifest["components"]["decode"], runtime)
        self.cache: list[torch.Tensor] | None = None

    def constant(self, name: str):
        """What the native route's program would return from its constant method `name` (from lower.json)."""
        return json.loads((self.folder / "lower.json").read_text())["constant_methods"][name]

    def reset(self) -> None:
        self.cache = None


class PrefillDecodeModule(_Pair):
    """Callable like the wrapped eager module: (tokens [1,T], positions [T]) -> logits; keeps the KV cache."""

    def __init__(self, folder: Path, runtime):
        super().__init__(folder, runtime)
        cache_in = self.decode.input_meta[self.decode.inputs["past_key_values"]]
        self.positions = [j for j, info in enumerate(cache_in) if _is_position(info)]
        pre_cache = self.prefill.input_meta[self.prefill.inputs["past_key_values"]]
        if not all(_is_position(info) for info in pre_cache) or len(pre_cache) != len(self.positions):
            raise LayoutError("prefill.pte's cache input should be the per-layer write positions of an empty "
                              f"StaticCache ({len(self.positions)} layers); it is {pre_cache}")
        mask = self.decode.inputs.get("attention_mask")
        self.context = self.decode.input_meta[mask.start][0][-1] if mask else None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        start = int(positions[0])
        if start == 0:
            zeros = [torch.tensor(0, dtype=torch.long) for _ in self.positions]
            out = self.prefill.run({"input_ids": tokens, "position_ids": positions[None], "past_key_values": zeros})
        else:
            if self.cache is None:
                raise RuntimeError("decode before prefill: the first call of a sequence must start at position 0")
            cache = list(self.cache)
            for j in self.positions:
                cache[j] = torch.tensor(start, dtype=torch.long)
            named = {"input_ids": tokens, "position_ids": positions[None], "past_key_values": cache}
            if "attention_mask" in self.decode.inputs:
                slots = torch.arange(self.context, dtype=torch.long)
                named["attention_mask"] = (slots[None, :] <= positions[:, None])[None, None]
            out = self.decode.run(named)
        self.cache = list(out["past_key_values"])
        (logits,) = out["logits"]
        return logits


class DynamicCacheModule(_Pair):
    """The DynamicCache layout (the exporter's mlx backend): (tokens [1,T], positions [T]) -> logits, the cache
    growing by T every call."""

    def __init__(self, folder: Path, runtime):
        super().__init__(folder, runtime)
        for p in (self.prefill, self.decode):
            if p.cache_type() != "DynamicCache":
                raise LayoutError(f"this runtime runs a DynamicCache; the programs take a {p.cache_type()}")
        if "attention_mask" in self.decode.inputs:
            raise LayoutError("decode.pte takes an attention_mask: this runtime runs the DynamicCache layout whose "
                              "mask is built in the graph from the cache length")
        pre = self.prefill.inputs["past_key_values"]
        if pre.stop != pre.start:
            raise LayoutError(f"prefill.pte's cache input should be an empty DynamicCache; it has "
                              f"{pre.stop - pre.start} tensors")
        cache_in = self.decode.input_meta[self.decode.inputs["past_key_values"]]
        if not cache_in or len(cache_in) % 2 or any(len(sizes) != 4 for sizes, _ in cache_in):
            raise LayoutError(f"decode.pte's cache input should be K/V pairs [1, Hkv, S, D] per layer; it is "
                              f"{[sizes for sizes, _ in cache_in]}")
        self.n_layers = len(cache_in) // 2
        lowered = folder / "lower.json"
        consts = json.loads(lowered.read_text())["constant_methods"] if lowered.exists() else {}
        self.context, self.chunk = consts.get("get_max_context_len"), consts.get("get_max_seq_len")
        self.length = 0

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        start, T = int(positions[0]), int(positions.numel())
        if not torch.equal(positions.to(torch.long), torch.arange(start, start + T)):
            raise ValueError(f"positions must be consecutive from {start} (the cache length is the position)")
        if self.chunk is not None and T > self.chunk:
            raise ValueError(f"{T} tokens in one call; the programs were exported for 1..{self.chunk}")
        if self.context is not None and start + T > self.context:
            raise ValueError(f"positions up to {start + T - 1} exceed the context {self.context}")
        if start == 0:
            out = self.prefill.run({"input_ids": tokens, "position_ids": positions[None], "past_key_values": []})
        else:
            if self.cache is None:
                raise RuntimeError("decode before prefill: the first call of a sequence must start at position 0")
            if start > self.length:
                raise RuntimeError(f"position {start} skips past the cache ({self.length} positions held)")
            cache = [c[:, :, :start].contiguous() if c.shape[2] > start else c for c in self.cache]
            out = self.decode.run({"input_ids": tokens, "position_ids": positions[None], "past_key_values": cache})
        self.cache = list(out["past_key_values"])
        if any(c.shape[2] != start + T for c in self.cache):
            raise LayoutError(f"the program returned a cache of {[c.shape[2] for c in self.cache]} positions, "
                              f"expected {start + T}")
        self.length = start + T
        (logits,) = out["logits"]
        return logits


def open_pair(folder: Path, runtime):
    """The layout class for the pair in `folder`, by the cache type its prefill was exported with."""
    from transformers.exporters.metadata import load_treespec
    manifest = json.loads((Path(folder) / "export.json").read_text())
    spec = load_treespec(manifest["components"]["prefill"]["metadata"]["in_spec"])
    _, kwargs = spec.children()
    types = {k: getattr(c.type, "__name__", None) for k, c in zip(_keys(kwargs), kwargs.children())}
    cache = types.get("past_key_values")
    layouts = {"DynamicCache": DynamicCacheModule, "StaticCache": PrefillDecodeModule}
    if cache not in layouts:
        raise LayoutError(f"{folder}: the programs take a {cache}; this runtime runs {sorted(layouts)}")
    return layouts[cache](folder, runtime)
