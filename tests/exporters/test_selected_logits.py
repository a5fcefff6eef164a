"""export.logits_mode=selected: forward takes a third input, rows Long[R], and returns those rows' logits
[1, R, V]; the build records the model's chat template (get_chat_template).

- the tiny Gemma 3 off-graph build with logits `selected` passes verify (the Python runtime asks the last row);
  its program returns the rows asked, equal to the same rows of one forward of the eager wrapper, and the C++
  batched runner shares decode forwards on it with the tokens of single-session runs;
- the chat template's name comes from the model's own template (SmolLM2: chatml; a model without one: raw).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline import abi
from tests.helpers import build


@pytest.fixture(scope="module")
def selected_build() -> dict:
    return build("tiny_gemma3_offgraph", "export.logits_mode=selected")


def test_selected_build_verifies_and_records_its_mode(selected_build):
    m = selected_build
    assert m["status"] == "ok"
    methods = json.loads((Path(m["pte"]).parent / "lower.json").read_text())["constant_methods"]
    assert methods[abi.LOGITS_MODE] == abi.LOGITS_MODE_CODES["selected"]
    assert methods[abi.CHAT_TEMPLATE] == abi.RAW_CHAT  # the tiny tokenizer has no chat template


def test_selected_program_returns_the_rows_asked(selected_build):
    """Rows [5, 0, 3] of a 6-token step come back in the order asked: the program's own rows of the same step
    asked all at once (bit for bit), and the eager wrapper's (XNNPACK's fp32 differs from eager by ~1e-3, as
    verify measures)."""
    from pipeline.model.cache_modes.offgraph import OffgraphLM
    from pipeline.model.kv.runtime_cache import run_step
    from pipeline.runtimes import RUNTIMES
    from pipeline.runtimes.base import RunnerProgram
    m = selected_build
    prog = RunnerProgram(RUNTIMES["executorch"], m["pte"], kernels=("llmpipe",))
    assert prog.selected
    tokens, positions = torch.tensor([[1, 17, 33, 5, 90, 64]]), torch.arange(6)

    def step(rows):
        prog.reset()
        return run_step(prog.cache, positions, lambda: prog.program.execute([tokens, positions, rows])[0]).clone()
    rows = torch.tensor([5, 0, 3])
    got, every = step(rows), step(torch.arange(6))
    assert tuple(got.shape) == (1, 3, 512) and tuple(every.shape) == (1, 6, 512)
    assert torch.equal(got, every[:, rows])
    (quantize,) = [s["path"] for s in m["stages"] if s["name"] == "quantize"]
    wrapped = torch.load(Path(quantize) / "module.pt", weights_only=False)  # the module that was exported
    assert isinstance(wrapped, OffgraphLM)
    with torch.no_grad():
        eager = wrapped(tokens, positions, rows)
    assert tuple(eager.shape) == (1, 3, 512)
    assert torch.allclose(got, eager, atol=5e-3), (got - eager).abs().max()


def test_batched_runner_shares_decode_forwards_on_selected(selected_build):
    from pipeline import native
    runner = native.runner_path(build=True)
    batched = native.BUILD_DIR / "llm_batched_runner"
    prompts = [[1, 17, 33, 5, 90, 64, 12, 77, 3, 45], [9, 8, 7], [1, 17, 33, 5, 90, 64, 12, 77, 3, 45, 101, 8, 60, 29]]
    proc = subprocess.run([str(batched), "--pte", selected_build["pte"], "--ids", "--quiet", "--max_new_tokens", "8",
                           "--ignore-eos", *(",".join(map(str, p)) for p in prompts)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    gens = [json.loads(ln.split(": ", 1)[1]) for ln in lines if ln.startswith("GEN_JSON: ")]
    (engine,) = [json.loads(ln.split(": ", 1)[1]) for ln in lines if ln.startswith("ENGINE_JSON: ")]
    assert engine["logits_mode"] == "selected" and engine["shared_decode_forwards"]
    assert engine["forwards"] < engine["decode_tokens"]  # several sessions' decode rows in one forward
    for p, g in zip(prompts, gens):
        single = subprocess.run([str(runner), "--pte", selected_build["pte"], "--prompt-ids", ",".join(map(str, p)),
                                 "--max-new-tokens", "8", "--kv-max-capacity", "64", "--ignore-eos", "--quiet"],
                                capture_output=True, text=True, timeout=120)
        assert single.returncode == 0, single.stderr[-2000:]
        (s,) = [ln for ln in single.stderr.splitlines() if ln.startswith("STATS_JSON: ")]
        assert g["generated_ids"] == json.loads(s.split(": ", 1)[1])["generated_ids"]


def test_chat_template_name_follows_the_model(smollm2_model_dir, tmp_path):
    assert abi.chat_template_name(smollm2_model_dir) == "chatml"
    cfg = json.loads((Path(smollm2_model_dir) / "tokenizer_config.json").read_text())
    for marker, name in (("<start_of_turn>user", "gemma"), ("<|start_header_id|>user", "llama3"),
                         ("<|turn>user", "gemma4"), (None, abi.RAW_CHAT)):
        d = tmp_path / name
        d.mkdir()
        for f in ("tokenizer.json", "special_tokens_map.json"):
            if (Path(smollm2_model_dir) / f).exists():
                (d / f).write_bytes((Path(smollm2_model_dir) / f).read_bytes())
        c = dict(cfg)
        c.pop("chat_template", None)
        if marker:
            c["chat_template"] = "{% for m in messages %}" + marker + "{{ m['content'] }}{% endfor %}"
        (d / "tokenizer_config.json").write_text(json.dumps(c))
        (d / "chat_template.jinja").unlink(missing_ok=True)
        assert abi.chat_template_name(d) == name
