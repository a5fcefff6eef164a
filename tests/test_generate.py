"""python -m pipeline generate: the Python runner. Its greedy tokens equal the C++ runner's on the same program in
every cache mode (past the sliding windows on the tiny Gemma), and verify's on the programs the C++ runner cannot
run (MLX, the transformers route's pair); the command streams, reports, samples reproducibly, and chats.
(Random tiny models repeat one token greedily, so the equality that tells most is on the real default program:
tests/e2e/test_smollm2.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import native
from pipeline.generation.builds import composition, latest_run
from pipeline.generation.runner import Sampler, Session, open_for_generation
from pipeline.runtimes import CachePolicy
from tests.helpers import ROOT, build, stage_path

NEW = 12


def _session(m: dict) -> Session:
    return Session(open_for_generation(Path(m["pte"]), CachePolicy()))


def _prompt(m: dict, n: int) -> list[int]:
    """n token ids of ordinary text, from the model's own tokenizer (random weights: any ids will do)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(m["tokenizer"])
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and then it runs far away. " * 8).ids
    return ids[:n]


@pytest.mark.parametrize("recipe, n", [
    ("tiny_llama_xnnpack", 10),      # static cache
    ("tiny_llama_custom", 10),       # in-graph custom cache
    ("tiny_llama_offgraph", 10),     # runtime-owned cache
    ("tiny_gemma3_custom", 30),      # rings (window 16, chunk 8): the prompt and decode wrap them
    ("tiny_gemma3_offgraph", 30),
])
def test_greedy_tokens_equal_the_cpp_runners(recipe, n):
    m = build(recipe, "verify.enabled=false")
    ids = _prompt(m, n)
    ours = _session(m).generate(ids, NEW, Sampler())
    theirs = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=NEW,
                        extra_args=native.cache_args(m))
    assert ours["generated_ids"] == theirs["generated_ids"]
    assert ours["stop_reason"] in ("eos", "max_new_tokens")


def test_kv_windows_keep_the_exported_chunk_as_the_cpp_runner_does():
    """--kv-windows narrower than the prefill chunk (4 < 8): rings hold window + chunk - 1 slots, the chunk stays as
    exported in both runners, so the tokens agree."""
    m = build("tiny_gemma3_offgraph", "verify.enabled=false")
    ids = _prompt(m, 30)
    session = Session(open_for_generation(Path(m["pte"]), CachePolicy(windows=[4, 0])))
    assert session.chunk == m["config"]["export"]["prefill_chunk"]
    ours = session.generate(ids, NEW, Sampler())
    theirs = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=NEW,
                        extra_args=native.cache_args(m) + ["--kv-windows", "4,0"])
    assert ours["generated_ids"] == theirs["generated_ids"]


@pytest.mark.parametrize("recipe", ["tiny_llama_mlx", "tiny_llama_hf_exporter"])
def test_greedy_tokens_equal_verifys_where_the_cpp_runner_cannot_run(recipe):
    m = build(recipe)
    report = json.loads((stage_path(m, "verify") / "report.json").read_text())
    session = _session(m)
    for p in report["prompts"]:
        ours = session.generate(p["prompt_ids"], len(p["pte"]), Sampler())
        assert ours["generated_ids"][:len(p["pte"])] == p["pte"], p["prompt"]


def test_a_session_reuses_its_prefix_and_restarts_when_it_differs():
    m = build("tiny_llama_offgraph", "verify.enabled=false")
    ids = _prompt(m, 10)
    fresh = _session(m).generate(ids + [5, 6, 7], NEW, Sampler())
    s = _session(m)
    s.generate(ids, 1, Sampler())
    held = len(s.held)
    again = s.generate(ids + [5, 6, 7], NEW, Sampler())  # continues the held prefix: only the new tokens are fed
    assert held == len(ids) and again["prompt_tokens_fed"] == 3
    assert again["generated_ids"] == fresh["generated_ids"]
    other = s.generate([7, 6, 5] + ids, NEW, Sampler())   # a different start: reset and feed it all
    assert other["prompt_tokens_fed"] == len(ids) + 3


def test_sampling_is_reproducible_by_seed_and_respects_top_k_and_top_p():
    import torch
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0)) * 3
    s1, s2 = Sampler(0.8, top_k=5, seed=3), Sampler(0.8, top_k=5, seed=3)
    draws = [s1(logits) for _ in range(50)]
    assert draws == [s2(logits) for _ in range(50)]
    assert set(draws) <= set(logits.topk(5).indices.tolist()) and len(set(draws)) > 1
    assert {Sampler(1.0, top_p=1e-6, seed=1)(logits) for _ in range(20)} == {int(logits.argmax())}
    assert Sampler()(logits) == int(logits.argmax())


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, input=stdin)


def _stats(stderr: str) -> list[dict]:
    return [json.loads(ln.split(": ", 1)[1]) for ln in stderr.splitlines() if ln.startswith("STATS_JSON: ")]


def test_the_command_streams_reports_and_chats():
    m = build("tiny_llama_custom", "verify.enabled=false")
    run = str(Path(m["run_manifest"]).parent)
    r = _cli("--run", run, "--prompt", "hello there", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    (stats,) = _stats(r.stderr)
    assert stats["text"] == r.stdout.rstrip("\n") and "TTFT" in r.stderr and "decode" in r.stderr
    assert 1 <= len(stats["generated_ids"]) <= 8
    assert f"[build] {run} (recipe tiny_llama_custom; build {m['build_hash']}" in r.stderr
    # the recipe's latest build as composed (verify.* does not change the program): this one's program
    latest = _cli("--recipe", "tiny_llama_custom", "--prompt", "hello there", "--max-new-tokens", "8")
    assert latest.returncode == 0 and "[build] " in latest.stderr and f"[program] {m['pte']} " in latest.stderr, \
        latest.stderr[-2000:]
    # the same program given as a bare --pte with its tokenizer
    bare = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "hello there", "--max-new-tokens", "8")
    assert bare.returncode == 0, bare.stderr[-2000:]
    # 4 KiB pages (--huge-pages off): the same tokens
    small = _cli("--run", run, "--prompt", "hello there", "--max-new-tokens", "8", "--huge-pages", "off")
    assert small.returncode == 0 and "0 MiB on 2 MiB pages" in small.stderr, small.stderr[-2000:]
    assert _stats(small.stderr)[0]["generated_ids"] == stats["generated_ids"]
    # sampling: the seed decides
    sampled = [_stats(_cli("--run", run, "--prompt", "hello", "--temperature", "1.0", "--top-p", "0.9",
                           "--seed", "7", "--max-new-tokens", "8").stderr)[0]["generated_ids"] for _ in range(2)]
    assert sampled[0] == sampled[1]
    chat = _cli("--run", run, "--interactive", "--max-new-tokens", "4", stdin="hello\nand again\n/reset\nhi\n/quit\n")
    assert chat.returncode == 0, chat.stderr[-2000:]
    turns = _stats(chat.stderr)
    assert len(turns) == 3
    assert turns[1]["prompt_tokens_fed"] < len(turns[1]["prompt_ids"]), "the second turn reuses the first's cache"
    assert turns[2]["prompt_tokens_fed"] == len(turns[2]["prompt_ids"]), "/reset starts over"


def test_without_run_the_default_compositions_latest_build_runs(tmp_path):
    """The newest build whose program is the composition's, not the newest build of anything: a sweep's point, a
    test's tiny model or a failed build is skipped."""
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"a program")

    def run(name: str, mtime: int, **fields) -> Path:
        f = tmp_path / "runs" / name / "manifest.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps({"status": "ok", "pte": str(pte), "model_dir": str(tmp_path), **fields}))
        os.utime(f, (mtime, mtime))
        return f

    default = composition()
    assert default != composition("smollm2_stock")
    plain = run("a", 100, recipe="default", composition=default)
    run("b", 200, recipe="default", composition="another")  # a sweep's point, or a test's overrides
    run("c", 300, recipe="default", composition=default, status="failed")
    run("d", 400, recipe="default")  # a manifest from before compositions were recorded
    run("e", 500, recipe="default", composition=default, pte=str(tmp_path / "gone.pte"))  # gc took its program
    assert latest_run(root=tmp_path) == plain
    with pytest.raises(SystemExit, match="no successful build of recipe gemma3_custom .*`python -m pipeline "
                                         "recipe=gemma3_custom`"):
        latest_run("gemma3_custom", tmp_path)
    r = _cli("--recipe", "no_such_recipe", "--prompt", "x")
    assert r.returncode == 1 and "--recipe no_such_recipe" in r.stderr and "Traceback" not in r.stderr


def test_bad_input_is_a_clear_error(tmp_path):
    assert _cli("--prompt", "x", "--max-new-tokens", "0").returncode == 2
    assert _cli("--max-new-tokens", "4").returncode == 2  # neither --prompt nor --interactive
    r = _cli("--pte", str(tmp_path / "none.pte"), "--tokenizer", "t.json", "--prompt", "x")
    assert r.returncode == 1 and "no such program" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "failed"}))
    r = _cli("--run", str(tmp_path), "--prompt", "x")
    assert r.returncode == 1 and "not a successful build" in r.stderr and "Traceback" not in r.stderr
