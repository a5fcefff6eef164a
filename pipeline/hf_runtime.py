"""The transformers exporter's two-program layout in the ExecuTorch Python runtime, behind the runner interface.

`PrefillDecodeModule(folder)(tokens Long[1, T], positions Long[T]) -> logits [1, T, V]`, like runtime.PteModule,
so verify's checks run on it unchanged:
- a call at position 0 starts a sequence: prefill.pte, which allocates the KV cache itself (its cache input is
  only each layer's write position);
- every later call runs decode.pte (exported with a dynamic token count, so it takes continuation chunks of a
  chunked prefill and single decode steps alike), fed the cache the previous call returned, a boolean mask
  [1, 1, T, context] (query row i sees the slots <= its position) and each layer's write position
  (`cumulative_length`) set to positions[0], so a rerun from an earlier position overwrites, as the native
  static cache does.
Which flat program input/output is which comes from the pytree specs the exporter recorded in export.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.runtime import load_kernels

# the inputs each program may take, beside the cache; anything else is a layout this runtime does not know
KNOWN_INPUTS = {"prefill": {"input_ids", "position_ids", "past_key_values"},
                "decode": {"input_ids", "attention_mask", "position_ids", "past_key_values"}}


class LayoutError(RuntimeError):
    pass


class _Program:
    """One exported program: its `forward` method and where each named input/output sits in the flat lists."""

    def __init__(self, folder: Path, name: str, entry: dict):
        from executorch.runtime import Runtime
        from transformers.exporters.metadata import load_treespec

        md = entry["metadata"]
        if md.get("in_constants"):
            raise LayoutError(f"{name}: traced constant inputs {md['in_constants']} are not supported")
        self.method = Runtime.get().load_program(folder / entry["file"]).load_method("forward")
        in_spec, out_spec = load_treespec(md["in_spec"]), load_treespec(md["out_spec"])
        _, kwargs = in_spec.children()  # forward(*(), **kwargs)
        self.inputs, i = {}, 0
        for key, child in zip(_keys(kwargs), kwargs.children()):
            self.inputs[key] = slice(i, i + child.num_leaves)
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
        meta = self.method.metadata
        self.input_meta = [meta.input_tensor_meta(j) for j in range(meta.num_inputs())]

    def run(self, named: dict) -> dict:
        feed = [None] * self.n_inputs
        for key, s in self.inputs.items():
            value = named[key]
            feed[s] = value if isinstance(value, list) else [value]
        out = list(self.method.execute(feed))
        tail = out[len(out) - self.n_outputs:]
        return {key: tail[s] for key, s in self.outputs.items()}


def _keys(spec) -> list[str]:
    ctx = spec.context
    return json.loads(ctx) if isinstance(ctx, str) else list(ctx)


LONG = 4  # ExecuTorch ScalarType code of int64


def _is_position(info) -> bool:
    # a layer's `cumulative_length`: the only 0-d int64 leaf of a StaticCache
    return tuple(info.sizes()) == () and info.dtype() == LONG


class PrefillDecodeModule:
    """Callable like the wrapped eager module: (tokens [1,T], positions [T]) -> logits; keeps the KV cache."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        load_kernels()
        manifest = json.loads((folder / "export.json").read_text())
        missing = [n for n in KNOWN_INPUTS if n not in manifest["components"]]
        if missing:
            raise LayoutError(f"{folder}/export.json has components {sorted(manifest['components'])}, "
                              f"missing {missing}")
        self.folder = folder
        self.prefill = _Program(folder, "prefill", manifest["components"]["prefill"])
        self.decode = _Program(folder, "decode", manifest["components"]["decode"])
        cache_in = self.decode.input_meta[self.decode.inputs["past_key_values"]]
        self.positions = [j for j, info in enumerate(cache_in) if _is_position(info)]
        pre_cache = self.prefill.input_meta[self.prefill.inputs["past_key_values"]]
        if not all(_is_position(info) for info in pre_cache) or len(pre_cache) != len(self.positions):
            raise LayoutError("prefill.pte's cache input should be the per-layer write positions of an empty "
                              f"StaticCache ({len(self.positions)} layers); it is {pre_cache}")
        mask = self.decode.inputs.get("attention_mask")
        self.context = self.decode.input_meta[mask.start].sizes()[-1] if mask else None
        self.cache: list[torch.Tensor] | None = None

    def constant(self, name: str):
        """What the native route's program would return from its constant method `name` (from lower.json)."""
        return json.loads((self.folder / "lower.json").read_text())["constant_methods"][name]

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
