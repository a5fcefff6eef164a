"""pipeline/corpus.py: the calibration set and the held-out domains, their hashes, and that they share no text."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from transformers import AutoTokenizer

from pipeline import corpus
from tests.helpers import build


@pytest.fixture
def corpus_copy(tmp_path, monkeypatch):
    """A copy of bench/corpus the test may edit, read by pipeline.corpus in place of the real one."""
    root = tmp_path / "corpus"
    shutil.copytree(corpus.DIR, root, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(corpus, "DIR", root)
    monkeypatch.setattr(corpus, "MANIFEST", root / "corpus.json")
    corpus.manifest.cache_clear()
    yield root
    corpus.manifest.cache_clear()


def _rehash(root, rel):
    m = json.loads((root / "corpus.json").read_text())
    m[rel]["sha256"] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
    (root / "corpus.json").write_text(json.dumps(m))
    corpus.manifest.cache_clear()


def test_the_committed_corpus_matches_its_hashes_and_is_disjoint():
    m = corpus.manifest()
    for rel, meta in m.items():
        assert corpus.sha256(corpus.DIR / rel) == meta["sha256"], rel
        assert meta["source"] and meta["licence"], rel
    heldout, calibration = corpus.files("heldout"), corpus.files("calibration")
    assert len(heldout) >= 5 and len(calibration) >= 5
    assert {"narrative", "chat", "code", "legal", "french"} <= set(heldout)
    corpus.check_disjoint()


def test_an_edited_file_is_refused(corpus_copy):
    path = corpus_copy / "calibration" / "code.txt"
    path.write_text(path.read_text() + "\n# one more line\n")
    with pytest.raises(corpus.CorpusError, match="calibration/code.txt: not the file"):
        corpus.text(path)


def test_a_held_out_line_in_the_calibration_set_is_refused(corpus_copy):
    line = next(ln for ln in (corpus_copy / "heldout" / "narrative.txt").read_text().splitlines() if len(ln) > 80)
    path = corpus_copy / "calibration" / "essays.txt"
    path.write_text(path.read_text() + "\n" + "  " + line + "\n")  # whitespace does not hide it
    _rehash(corpus_copy, "calibration/essays.txt")
    with pytest.raises(corpus.CorpusError, match="held-out domain 'narrative'.*shares 1 line"):
        corpus.check_disjoint()


@pytest.fixture(scope="module")
def tiny():
    return build("tiny_llama_xnnpack", stages=("download",))


def test_calibration_covers_every_domain_in_sequences(tiny):
    tok = AutoTokenizer.from_pretrained(tiny["model_dir"])
    seqs = corpus.calibration_ids(tok, n_ctx=128, per_domain=256)
    assert all(0 < len(s) <= 128 for s in seqs)
    assert sum(map(len, seqs)) == 256 * len(corpus.files("calibration"))  # every domain holds 256 tokens or more
    chunks = corpus.heldout_chunks(tok, 64, 2)
    assert set(chunks) == set(corpus.files("heldout")) and all(len(c) == 2 for c in chunks.values())
    heads = corpus.calibration_heads(tok, 64)  # the sensitivity pass's rows: each domain's first tokens
    assert len(heads) == len(corpus.files("calibration")) and all(len(h) == 64 for h in heads)
    assert heads == [s[:64] for s in seqs[::2]] and len({tuple(h) for h in heads}) == len(heads)


def test_chats_go_through_the_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny["model_dir"])
    plain = corpus.ids(tok, corpus.files("calibration")["chat"])       # no template: turns as paragraphs
    tok.chat_template = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
    templated = tok.decode(corpus.ids(tok, corpus.files("calibration")["chat"]))
    assert templated.startswith("<<user>>What does the `ls` command do") and "<<assistant>>" in templated
    assert len(plain) < len(tok(templated)["input_ids"])


def test_the_calibrate_stage_records_its_files_by_hash():
    r = build("tiny_llama_xnnpack", "quantize=8da4w_gptq", stages=("download", "wrap", "calibrate"))
    cal = next(s for s in r["stages"] if s["name"] == "calibrate")
    assert cal["metrics"]["calibration_files"] == corpus.calibration_record()
    assert cal["metrics"]["calibration_tokens"] > 4000
