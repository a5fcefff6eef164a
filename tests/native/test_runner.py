"""llm_runner on tiny exported programs: parity with the ExecuTorch Python runtime, stats, errors."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from native_tiny_export import CHUNK, CTX, VOCAB


def runner(bins, *args, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(bins[0]), *map(str, args)], capture_output=True, text=True,
                          errors="replace", input=stdin, timeout=timeout,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def stats_lines(proc) -> list[dict]:
    return [json.loads(line.split("STATS_JSON: ", 1)[1]) for line in proc.stderr.split("\n")
            if line.startswith("STATS_JSON: ")]


def ids_arg(ids) -> str:
    return ",".join(str(i) for i in ids)


@pytest.fixture(scope="session")
def reference(tiny_programs) -> dict:
    return json.loads((tiny_programs / "reference.json").read_text())


def test_help_lists_every_default(native_bins):
    proc = runner(native_bins, "--help")
    assert proc.returncode == 0
    for flag in ("--pte", "--tokenizer", "--prompt", "--prompt-ids", "--max-new-tokens", "--temperature",
                 "--top-p", "--top-k", "--seed", "--chat", "--warmup", "--interactive", "--stats-json",
                 "--encode", "--threads", "--huge-pages"):
        assert flag in proc.stdout
    for default in ("(default: 50)", "(default: 0)", "(default: 1)", "(default: 42)", "llama3 | gemma | gemma4 | chatml"):
        assert default in proc.stdout


@pytest.mark.parametrize("name", ["tiny_last", "tiny_8da4w"])
def test_greedy_matches_python_runtime(name, native_bins, tiny_programs, reference):
    # 26 prompt ids > chunk 16: exercises chunked prefill.
    assert len(reference["prompt_ids"]) > CHUNK
    # --ignore-eos: the whole budget, as the reference (a stop token would cut the comparison short)
    proc = runner(native_bins, "--pte", tiny_programs / f"{name}.pte", "--prompt-ids",
                  ids_arg(reference["prompt_ids"]), "--max-new-tokens", reference["n_new"], "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    (stats,) = stats_lines(proc)
    assert stats["prompt_ids"] == reference["prompt_ids"]
    assert stats["generated_ids"] == reference[name] and len(reference[name]) == reference["n_new"]
    assert stats["recipe_hash"] == "tiny-test-recipe"
    assert stats["logits_mode"] == "last"  # 'full' and 'selected': see the counter programs


@pytest.mark.parametrize("name", ["counter_half_full", "counter_bf16_last", "counter_fp32_selected"])
def test_logits_dtypes_modes_and_eos(name, native_bins, tiny_programs):
    # 11 prompt ids > chunk 8; next token = last + 1; EOS 60 ends the turn (and is reported)
    prompt = list(range(50, 58)) + [40, 41, 42]
    proc = runner(native_bins, "--pte", tiny_programs / f"{name}.pte", "--prompt-ids", ids_arg(prompt),
                  "--max-new-tokens", 40)
    assert proc.returncode == 0, proc.stderr
    (stats,) = stats_lines(proc)
    assert stats["generated_ids"] == list(range(43, 61))
    assert stats["stop_reason"] == "stop_token"
    assert stats["logits_dtype"] == {"half": "Half", "bf16": "BFloat16", "fp32": "Float"}[name.split("_")[1]]
    assert stats["logits_mode"] == name.split("_")[2]
    assert stats["recipe_hash"] == "12345"  # an Int constant, printed as text
    assert "recipe_hash 12345" in proc.stderr


def test_quantized_program_uses_quantized_kernels(tiny_programs):
    # the 4-bit embedding runs outside the XNNPACK delegate: the runner must have the kernel
    assert b"quantized_decomposed::embedding_4bit" in (tiny_programs / "tiny_8da4w.pte").read_bytes()


def test_report_and_stats_json(native_bins, tiny_programs, reference, tmp_path):
    out = tmp_path / "stats.json"
    proc = runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--prompt-ids",
                  ids_arg(reference["prompt_ids"][:5]), "--max-new-tokens", 6, "--stats-json", out,
                  "--warmup")
    assert proc.returncode == 0, proc.stderr
    (line_stats,) = stats_lines(proc)
    file_stats = json.loads(out.read_text().strip())
    assert file_stats == line_stats
    for key in ("prompt_tokens", "generated_tokens", "load_ms", "ttft_ms", "prefill_tok_s", "decode_tok_s",
                "sampling_ms", "rss_after_load_mib", "rss_after_prefill_mib", "rss_after_decode_mib",
                "peak_rss_mib", "prompt_ids", "generated_ids", "text", "stop_reason"):
        assert key in file_stats, key
    assert file_stats["prompt_tokens"] == 5 and file_stats["generated_tokens"] == 6
    assert file_stats["peak_rss_mib"] >= file_stats["rss_after_load_mib"] > 0
    assert file_stats["decode_tok_s"] > 0 and file_stats["prefill_tok_s"] > 0
    # warmup must not leak into the session
    assert file_stats["generated_ids"] == reference_prefix(native_bins, tiny_programs, reference)
    for needle in ("[memory]", "[stats]", "ttft", "prefill", "decode", "tok/s", "recipe_hash tiny-test-recipe"):
        assert needle in proc.stderr
    assert "I 00:" not in proc.stderr  # ExecuTorch Info logs are silenced


def reference_prefix(bins, programs, reference):
    proc = runner(bins, "--pte", programs / "tiny_last.pte", "--prompt-ids",
                  ids_arg(reference["prompt_ids"][:5]), "--max-new-tokens", 6)
    return stats_lines(proc)[0]["generated_ids"]


def test_context_limits(native_bins, tiny_programs):
    pte = tiny_programs / "tiny_last.pte"
    ids = [5 + (i * 37) % 1000 for i in range(CTX)]
    # 90 prompt tokens in a context of 96: at most 96 - 90 + 1 tokens can be produced.
    proc = runner(native_bins, "--pte", pte, "--prompt-ids", ids_arg(ids[:90]), "--max-new-tokens", 50,
                  "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    (stats,) = stats_lines(proc)
    assert stats["stop_reason"] == "context_full"
    assert stats["generated_tokens"] == CTX - 90 + 1
    # a prompt that fills the context exactly still yields one token
    proc = runner(native_bins, "--pte", pte, "--prompt-ids", ids_arg(ids), "--max-new-tokens", 5)
    assert proc.returncode == 0, proc.stderr
    assert stats_lines(proc)[0]["generated_tokens"] == 1


def test_sampling_is_seeded(native_bins, tiny_programs, reference):
    def sample(seed):
        proc = runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--prompt-ids",
                      ids_arg(reference["prompt_ids"]), "--max-new-tokens", 12, "--temperature", 1.5,
                      "--top-p", 0.95, "--top-k", 500, "--seed", seed)
        assert proc.returncode == 0, proc.stderr
        return stats_lines(proc)[0]["generated_ids"]

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b
    assert a != c


def _expect_error(proc, needle, codes=(1, 2)):
    assert proc.returncode in codes, (proc.returncode, proc.stderr)
    assert needle in proc.stderr, proc.stderr
    assert "error:" in proc.stderr
    assert "STATS_JSON" not in proc.stderr


def test_errors_are_messages_not_crashes(native_bins, tiny_programs, tmp_path):
    good = tiny_programs / "tiny_last.pte"
    garbage = tmp_path / "garbage.pte"
    garbage.write_bytes(bytes(range(256)) * 64)
    truncated = tmp_path / "truncated.pte"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    cases = [
        (["--pte", tmp_path / "missing.pte", "--prompt-ids", "1,2"], "cannot open .pte file"),
        (["--pte", garbage, "--prompt-ids", "1,2"], "cannot load .pte file"),
        (["--pte", truncated, "--prompt-ids", "1,2"], ".pte"),
        (["--pte", good, "--prompt-ids", ids_arg(range(1, CTX + 2))],
         f"the prompt has {CTX + 1} tokens but the program's context holds {CTX}"),
        (["--pte", good, "--prompt-ids", "1,2", "--chat", "vicuna"], "unknown chat template 'vicuna'"),
        (["--pte", tiny_programs / "no_consts.pte", "--prompt-ids", "1,2"],
         "no constant method 'get_max_context_len'"),
        (["--pte", tiny_programs / "bad_consts.pte", "--prompt-ids", "1,2"],
         "'get_max_context_len' returned 0"),
        (["--pte", good, "--prompt-ids", f"1,{VOCAB}"], "outside the vocabulary"),
        (["--pte", good, "--prompt-ids", "1,x"], "--prompt-ids expects an integer"),
        (["--prompt-ids", "1,2"], "--pte is required"),
        (["--pte", good, "--prompt", "hi"], "--tokenizer is required"),
        (["--pte", good, "--prompt-ids", "1", "--bogus"], "unknown argument '--bogus'"),
        (["--pte", good, "--prompt-ids", "1", "--huge-pages", "maybe"], "--huge-pages takes on or off, got 'maybe'"),
        (["--pte", good, "--prompt-ids", "1", "--tokenizer", tmp_path / "none.json"],
         "cannot open tokenizer file"),
    ]
    for args, needle in cases:
        _expect_error(runner(native_bins, *args), needle)


@pytest.mark.real_model
def test_vocab_mismatch_is_an_error(native_bins, tiny_programs, gemma3_model_dir, smollm2_model_dir):
    proc = runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--tokenizer",
                  Path(gemma3_model_dir) / "tokenizer.json", "--prompt", "hi")
    _expect_error(proc, "tokenizer vocabulary (262144 ids) does not match the program's vocabulary (49152)")
    # equal sizes are fine
    proc = runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--tokenizer",
                  Path(smollm2_model_dir) / "tokenizer.json", "--prompt", "hi", "--max-new-tokens", 2)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.real_model
def test_prompt_text_and_streamed_output(native_bins, tiny_programs, smollm2_model_dir):
    from tokenizers import Tokenizer

    tok_path = Path(smollm2_model_dir) / "tokenizer.json"
    proc = runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--tokenizer", tok_path,
                  "--prompt", "What is the capital of France?", "--chat", "chatml", "--max-new-tokens", 24)
    assert proc.returncode == 0, proc.stderr
    (stats,) = stats_lines(proc)
    hf = Tokenizer.from_file(str(tok_path))
    gen = [i for i in stats["generated_ids"] if i not in (2, 0)]  # stop tokens are not printed
    expected = hf.decode(gen, skip_special_tokens=False)
    assert stats["text"] == expected
    assert proc.stdout == expected + "\n"
    assert stats["prompt_ids"][:3] == [1, 9690, 198]  # <|im_start|>system\n


@pytest.mark.real_model
def test_interactive_turns_undo_reset(native_bins, tiny_programs, smollm2_model_dir):
    long_turn = " ".join(["word"] * 150)
    script = "\n".join(["Hello there", "/undo", "Hello there", "/undo 5", "second turn", long_turn,
                        "/reset", "Hello there", "/quit", "never read"]) + "\n"
    proc = runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--tokenizer",
                  Path(smollm2_model_dir) / "tokenizer.json", "--chat", "chatml", "--interactive",
                  "--max-new-tokens", 6, stdin=script)
    assert proc.returncode == 0, proc.stderr
    turns = stats_lines(proc)
    assert len(turns) == 4, proc.stderr
    first, after_undo, second, after_reset = turns
    assert after_undo["prompt_ids"] == first["prompt_ids"]
    assert after_undo["generated_ids"] == first["generated_ids"]
    assert after_reset["prompt_ids"] == first["prompt_ids"]
    assert after_reset["generated_ids"] == first["generated_ids"]
    # the second turn continues the context: it closes the previous model turn first
    # (the last generated token, not yet fed, comes first when the budget ended the turn)
    assert second["cache_length"] > first["cache_length"]
    im_end = 2
    if first["stop_reason"] == "stop_token":
        assert second["prompt_ids"][0] == im_end
    else:
        assert second["prompt_ids"][:2] == [first["generated_ids"][-1], im_end]
    assert "cannot undo 5 turn(s)" in proc.stderr
    assert "[refused]" in proc.stderr
