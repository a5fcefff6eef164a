"""The server on the real models: gemma-3-270m's off-graph build, which the CI tier makes anyway (its GGUF carries no
chat template, so the server takes its built-in gemma one; the greedy answer equals llm_runner's, the stream the plain
answer, a json_schema answer parses, tools are refused for a template without them); and in the slow tier the default
recipe's serving form, built as `python -m pipeline.serve --build` builds it (a chat answer naming Paris)."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from pipeline import native
from pipeline.serve.__main__ import SERVING
from tests.helpers import build_cli
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.real_model
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"]}


def manifest_path(m: dict) -> str:
    return m["stdout"].strip().splitlines()[-1].split(": ", 1)[1]


def check_answers(server: ServerProcess, model: str, expected: str = "Paris") -> OpenAI:
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    plain = client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=24)
    assert expected in plain.choices[0].message.content, plain.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].message.content
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Name a European capital and its country, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    return client


def test_gemma3_offgraph_served(gemma3_offgraph):
    # this Q4_K_M-derived 270m model echoes the question rather than answer it (tests/native/test_batched_runner.py):
    # the check is llm_runner's greedy text, with the same turn format
    m = gemma3_offgraph
    single = native.run(m["pte"], m["tokenizer"], prompt=PARIS[0]["content"], chat="gemma", max_new_tokens=24,
                        extra_args=["--kv-max-capacity", "1024"])
    server = ServerProcess("--run", manifest_path(m), "--sessions", "2")  # the built-in gemma template
    try:
        client = check_answers(server, "gemma-3-270m", single["text"].strip())
        with pytest.raises(BadRequestError, match="no tool-call format"):
            client.chat.completions.create(model="gemma-3-270m", messages=PARIS, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    finally:
        server.stop()
    assert "Traceback" not in server.text


@pytest.mark.slow
def test_the_default_recipe_served_from_its_serving_form():
    build_cli(None, *SERVING)
    server = ServerProcess()  # no --run: the default recipe's latest serving build
    try:
        model = "smollm2-135m-instruct"
        client = check_answers(server, model)
        first = client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=24)
        turn2 = PARIS + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And of Italy?"}]
        second = client.chat.completions.create(model=model, messages=turn2, temperature=0, max_tokens=24)
        # the reply is resumed from the first turn's snapshot, not prefilled again
        assert second.usage.prompt_tokens_details.cached_tokens >= \
            first.usage.prompt_tokens + first.usage.completion_tokens - 2

        async def eight():
            ac = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
            return await asyncio.gather(*(ac.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}],
                temperature=0, max_tokens=32) for i in range(8)))
        assert all(r.choices[0].message.content for r in asyncio.run(eight()))
    finally:
        server.stop()
    assert "Traceback" not in server.text
