"""The texts quantization learns from and the held-out texts fidelity is scored on (bench/corpus).

bench/corpus/corpus.json lists every file with its role (calibration or heldout), domain, source, licence and sha256;
bench/corpus/build.py rebuilds them from their offline sources. A file whose bytes no longer match its sha256 is
refused, and so is a held-out file sharing a line with a calibration file (`check_disjoint`): a held-out figure
must come from text nothing was fitted on. Chats (.json, a list of conversations) go through the model's own chat
template, so the calibration and the scores see the tokens a chat app sends.
"""
from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path

from pipeline import paths

DIR = paths.ROOT / "bench" / "corpus"
MANIFEST = DIR / "corpus.json"
# calibration tokens per domain, in sequences of at most 512: eight domains, about 8k tokens
CALIBRATION_TOKENS = 1024
# a line this long or longer is a fingerprint of its document; shorter ones (a `return x`, a blank item) recur anywhere
FINGERPRINT_CHARS = 40


class CorpusError(RuntimeError):
    pass


@lru_cache(maxsize=None)
def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def files(role: str) -> dict[str, Path]:
    """domain -> file of one role ("calibration" or "heldout"), in the manifest's order."""
    return {meta["domain"]: DIR / rel for rel, meta in manifest().items() if meta["role"] == role}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def text(path: Path) -> str:
    """A corpus file's text, refused when its bytes are not the ones the manifest recorded."""
    rel = path.relative_to(DIR).as_posix()
    want = manifest().get(rel, {}).get("sha256")
    if want is None or sha256(path) != want:
        raise CorpusError(f"bench/corpus/{rel}: not the file bench/corpus/corpus.json records (sha256 "
                          f"{sha256(path)[:12]}, recorded {str(want)[:12]}); rebuild with bench/corpus/build.py")
    return path.read_text(encoding="utf-8")


def ids(tokenizer, path: Path) -> list[int]:
    """A file's token ids: plain text as it is, a chat file through the tokenizer's chat template (a tokenizer without
    one, a base model's, reads each turn as a paragraph)."""
    body = text(path)
    if path.suffix == ".json":
        chats = json.loads(body)
        body = ("".join(tokenizer.apply_chat_template(c, tokenize=False) for c in chats) if tokenizer.chat_template
                else "\n\n".join(turn["content"] for c in chats for turn in c))
    return tokenizer(body, add_special_tokens=False)["input_ids"]


def calibration_ids(tokenizer, n_ctx: int = 512, per_domain: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """The first `per_domain` tokens of each calibration domain, as sequences of at most n_ctx tokens."""
    out = []
    for path in files("calibration").values():
        domain = ids(tokenizer, path)[:per_domain]
        out += [domain[i:i + n_ctx] for i in range(0, len(domain), n_ctx)]
    return out


def calibration_heads(tokenizer, n: int) -> list[list[int]]:
    """The first n tokens of each calibration domain, one row each: a short pass that samples every domain."""
    return [ids(tokenizer, path)[:n] for path in files("calibration").values()]


def chunks_of(tokenizer, tokens: list[int], n_ctx: int, n_chunks: int | None = None, what: str = "the corpus"
              ) -> list[list[int]]:
    """Token ids as chunks of n_ctx, each opening with BOS when the tokenizer adds one."""
    probe = tokenizer("a")["input_ids"]
    bos = [probe[0]] if tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id else []
    body = n_ctx - len(bos)
    chunks = [bos + tokens[i:i + body] for i in range(0, len(tokens) - body + 1, body)]
    if n_chunks is not None:
        if len(chunks) < n_chunks:
            raise ValueError(f"{what} holds {len(chunks)} chunks of {n_ctx} tokens, {n_chunks} asked for")
        chunks = chunks[:n_chunks]
    return chunks


def heldout_chunks(tokenizer, n_ctx: int, n_chunks: int) -> dict[str, list[list[int]]]:
    """domain -> the first n_chunks chunks of each held-out domain (bench/corpus, checked disjoint from the
    calibration set first)."""
    check_disjoint()
    return {domain: chunks_of(tokenizer, ids(tokenizer, path), n_ctx, n_chunks, f"held-out {domain}")
            for domain, path in files("heldout").items()}


def calibration_record() -> dict:
    """What a calibration used, by file and hash: the calibrate stage's manifest carries it."""
    return {rel: meta["sha256"] for rel, meta in manifest().items() if meta["role"] == "calibration"}


def _fingerprints(path: Path) -> dict[str, str]:
    lines = (re.sub(r"\s+", " ", ln).strip() for ln in text(path).replace("\\n", "\n").splitlines())
    return {hashlib.sha256(ln.encode()).hexdigest(): ln for ln in lines if len(ln) >= FINGERPRINT_CHARS}


def check_disjoint() -> None:
    """Raise if any held-out file shares a line (by hash, whitespace folded) with any calibration file."""
    calibrated = {}
    for path in files("calibration").values():
        calibrated.update({h: (path, ln) for h, ln in _fingerprints(path).items()})
    for domain, path in files("heldout").items():
        shared = [calibrated[h] for h in _fingerprints(path) if h in calibrated]
        if shared:
            where, line = shared[0]
            raise CorpusError(f"held-out domain {domain!r} ({path.name}) shares {len(shared)} line(s) with the "
                              f"calibration set, e.g. {where.relative_to(DIR)}: {line[:80]!r}")
