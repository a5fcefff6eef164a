"""Schema- and grammar-constrained output (pipeline/constrain.py; llm_runner through its sidecar): every output parses
and validates against its schema: 50 of 50 sampled outputs of a tiny random model (Python runner), 50 of 50 greedy
answers of the real default program (Python runner, and the C++ runner in one interactive session); a GBNF grammar
holds too; a draft is checked against the grammar so a constrained run still speculates, its greedy tokens those of
the constrained plain run; a bad schema or grammar is one clear error before any token."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest

from pipeline import native
from pipeline.constrain import Constraint, grammar_text, tokenizer_for
from pipeline.generate import Sampler, Session, Text, open_for_generation
from pipeline.runtimes import CachePolicy
from tests.helpers import build
from tests.test_generate import _cli, _stats

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Paris"]
PROMPTS = [f"Give the record of {n}, aged {20 + 3 * i + j}, who lives in {CITIES[j]}, as JSON."
           for i, n in enumerate(NAMES) for j in range(5)]


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("schema") / "person.json"
    p.write_text(json.dumps(SCHEMA))
    return p


def _valid(text: str) -> dict:
    record = json.loads(text)
    jsonschema.validate(record, SCHEMA)
    return record


def test_fifty_sampled_outputs_of_a_tiny_model_parse_and_validate(schema_file):
    m = build("tiny_llama_offgraph", "verify.enabled=false", "export.max_context_len=256")
    text = Text(None, Path(m["tokenizer"]), "raw")
    session = Session(open_for_generation(Path(m["pte"]), CachePolicy()))
    grammar, lltok = grammar_text(schema_file), None
    lltok = tokenizer_for(text.fast_tokenizer(), session.vocab)
    for seed, prompt in enumerate(PROMPTS):
        session.reset()
        c = Constraint(grammar, lltok, session.vocab)
        out = session.generate(text.encode(prompt), 200, Sampler(1.0, seed=seed, constraint=c))
        assert out["stop_reason"] in ("eos", "grammar"), (prompt, out["stop_reason"], text.decode(out["generated_ids"]))
        _valid(text.decode(out["generated_ids"]))


def test_fifty_answers_of_the_default_program_parse_and_validate(smollm2_default, schema_file, tmp_path):
    """Python runner, greedy, each prompt with speculation on (the records quote their prompt); and llm_runner in one
    interactive session (/reset between the prompts), its grammar in the sidecar."""
    m = smollm2_default
    text = Text(Path(m["model_dir"]), None, "auto")
    session = Session(open_for_generation(Path(m["pte"]), CachePolicy()))
    from pipeline.speculate import Speculation
    spec = Session(open_for_generation(Path(m["pte"]), CachePolicy()), Speculation())
    grammar = grammar_text(schema_file)
    lltok = tokenizer_for(text.fast_tokenizer(), session.vocab)
    python_records, drafted = [], 0
    for i, prompt in enumerate(PROMPTS):
        ids = text.prompt_ids([{"role": "user", "content": prompt}])
        s = spec if i % 5 == 0 else session  # every fifth speculates; its tokens must be the plain run's
        s.reset()
        out = s.generate(ids, 120, Sampler(constraint=Constraint(grammar, lltok, session.vocab)))
        python_records.append(_valid(text.decode(out["generated_ids"])))
        if s is spec:
            drafted += out["speculation"]["drafted"]
            session.reset()
            plain = session.generate(ids, 120, Sampler(constraint=Constraint(grammar, lltok, session.vocab)))
            assert plain["generated_ids"] == out["generated_ids"], prompt
    assert drafted > 0
    assert sum(r["name"] in p for r, p in zip(python_records, PROMPTS)) >= 25  # it answers the prompt, not noise
    script = "".join(f"{p}\n/reset\n" for p in PROMPTS) + "/quit\n"
    proc = subprocess.run([str(native.runner_path()), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--interactive",
                           "--json-schema", str(schema_file), "--max-new-tokens", "120", "--quiet",
                           "--stats-json", str(tmp_path / "turns.jsonl")],
                          input=script, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    turns = [json.loads(ln) for ln in (tmp_path / "turns.jsonl").read_text().splitlines()]
    assert len(turns) == 50
    cpp_records = [_valid(t["text"]) for t in turns]
    assert cpp_records == python_records  # the same greedy tokens under the same grammar
    assert all(t["grammar"]["mask_ms_per_token"] < 50 for t in turns)


def test_a_gbnf_grammar_holds_and_a_bad_one_is_refused_before_any_token(tmp_path, schema_file):
    m = build("tiny_llama_offgraph", "verify.enabled=false")
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= "answer: " ("yes" | "no") "."\n')
    for seed in range(2):
        r = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "is it?", "--grammar", str(gbnf),
                 "--temperature", "1.0", "--seed", str(seed), "--max-new-tokens", "20", "--kv-max-capacity", "64")
        assert r.returncode == 0, r.stderr[-2000:]
        assert _stats(r.stderr)[0]["text"] in ("answer: yes.", "answer: no.")
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objectx"}')
    broken = tmp_path / "broken.json"
    broken.write_text('{"type": ')
    for flag, path, why in [("--json-schema", bad, "objectx"), ("--json-schema", broken, "not JSON"),
                            ("--json-schema", tmp_path / "none.json", "No such file")]:
        r = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "x", flag, str(path))
        assert r.returncode == 1 and why in r.stderr and str(path) in r.stderr, r.stderr[-1000:]
        assert "Traceback" not in r.stderr and "STATS_JSON" not in r.stderr
    # llm_runner: its sidecar compiles the grammar before any token (the same code: one case is enough)
    proc = subprocess.run([str(native.runner_path()), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "x",
                           "--kv-max-capacity", "64", "--json-schema", str(bad)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "objectx" in proc.stderr and "STATS_JSON" not in proc.stderr, proc.stderr[-1000:]
