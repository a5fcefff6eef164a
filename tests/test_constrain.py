"""Schema- and grammar-constrained output (pipeline/generation/constrain.py; llm_runner through its sidecar): every
output parses and validates against its schema: 50 of 50 sampled outputs of a tiny random model (Python runner), 50
of 50 greedy answers of the real default program (Python runner, and the C++ runner in one interactive session); a
GBNF grammar holds too; a draft is checked against the grammar so a constrained run still speculates, its greedy
tokens those of the constrained plain run; a bad schema or grammar is one clear error before any token."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest

from pipeline import native
from pipeline.generation.constrain import Constraint, grammar_text, tokenizer_for
from pipeline.generation.runner import Sampler, Session, Text, open_for_generation
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
    from pipeline.generation.speculate import Speculation
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
    # every token was sampled under the grammar's mask (its speed is bench/grammar_engines.py's, not a test's)
    assert [t["grammar"]["masks"] for t in turns] == [t["generated_tokens"] for t in turns]


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


ORDINARY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["city", "population"]}  # additionalProperties unset, as most schemas people write


def test_a_schema_is_closed_to_properties_it_does_not_name_unless_it_allows_them():
    from pipeline.generation.constrain import closed
    nested = {**ORDINARY, "properties": {**ORDINARY["properties"], "where": {"properties": {"x": {}}}}}
    c = closed(nested)
    assert c["additionalProperties"] is False and c["properties"]["where"]["additionalProperties"] is False
    assert closed({**ORDINARY, "additionalProperties": True})["additionalProperties"] is True
    assert closed({"type": "object"}) == {"type": "object"}  # names none: any object
    # requires a property it does not name: closing it would leave no valid output
    assert "additionalProperties" not in closed({"properties": {"a": {}}, "required": ["a", "b"]})
    both = closed({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})  # each names half of them
    assert all("additionalProperties" not in s for s in both["allOf"])
    assert closed({"enum": [{"properties": 1}]}) == {"enum": [{"properties": 1}]}  # data, not a schema
    # an integer's digits end (I-JSON's range) unless the schema bounds it itself
    assert c["properties"]["population"] == {"type": "integer", "minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert closed({"type": "integer", "maximum": 9})["maximum"] == 9


def test_an_ordinary_schema_gives_parsing_json_of_its_properties_on_the_default_build(smollm2_default, tmp_path):
    """The schema users write (two required properties, additionalProperties unset): its two keys only, JSON that
    parses, in both runners, with the default build."""
    m = smollm2_default
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(ORDINARY))
    prompt = "Give the capital of France and its population as JSON."
    py = _cli("--pte", m["pte"], "--model-dir", m["model_dir"], "--prompt", prompt, "--json-schema", str(schema),
              "--max-new-tokens", "64")
    assert py.returncode == 0, py.stderr[-2000:]
    proc = subprocess.run([str(native.runner_path()), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt",
                           prompt, "--json-schema", str(schema), "--max-new-tokens", "64", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for stats, grammar in ((_stats(py.stderr)[0], "constraint"), (_stats(proc.stderr)[0], "grammar")):
        record = json.loads(stats["text"])
        assert set(record) == {"city", "population"} and isinstance(record["population"], int), stats["text"]
        jsonschema.validate(record, ORDINARY)
        assert stats["stop_reason"] in ("eos", "grammar", "stop_token") and stats[grammar]["complete"], stats


def test_a_limit_before_the_grammars_end_is_reported_in_both_runners(schema_file):
    m = build("tiny_llama_offgraph", "verify.enabled=false")
    py = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "a record", "--json-schema",
              str(schema_file), "--max-new-tokens", "3", "--kv-max-capacity", "64")
    proc = subprocess.run([str(native.runner_path()), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt",
                           "a record", "--json-schema", str(schema_file), "--max-new-tokens", "3",
                           "--kv-max-capacity", "64", "--chat", "0"], capture_output=True, text=True, timeout=300)
    for r, key in ((py, "constraint"), (proc, "grammar")):
        assert r.returncode == 0, r.stderr[-2000:]
        (stats,) = _stats(r.stderr)
        assert stats["stop_reason"] == "length" and stats[key]["complete"] is False, stats
        assert len(stats["generated_ids"]) == 3 and "warning: the output is incomplete" in r.stderr
    # the context's end (64 positions) before the grammar's: the same warning; with room to finish, none
    full = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "a record", "--json-schema",
                str(schema_file), "--max-new-tokens", "200", "--kv-max-capacity", "64")
    (stats,) = _stats(full.stderr)
    assert stats["stop_reason"] == "context" and stats["constraint"]["complete"] is False, stats  # greedy: it loops
    assert "the context's end came before" in full.stderr
    roomy = build("tiny_llama_offgraph", "verify.enabled=false", "export.max_context_len=256")
    done = _cli("--pte", roomy["pte"], "--tokenizer", roomy["tokenizer"], "--prompt", "a record", "--json-schema",
                str(schema_file), "--max-new-tokens", "200", "--temperature", "1.0", "--seed", "0")
    (stats,) = _stats(done.stderr)
    assert stats["stop_reason"] in ("eos", "grammar") and stats["constraint"]["complete"] is True, stats
    assert "incomplete" not in done.stderr
    _valid(stats["text"])
