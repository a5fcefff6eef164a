"""python -m pipeline.serve on a tiny off-graph build (a random llama, logits for every row): the OpenAI client's
answers (chat, streaming, json_schema, tools, n and seed, stop strings, completions), batching, the prefix cache
across turns, the errors, the bounded queue, disconnects, and a fuzz of malformed requests. The server runs as a
process of its own on 127.0.0.1, with a ChatML template that renders tools (the tiny tokenizer has none)."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx2 as httpx  # the openai client's HTTP library
import jsonschema
import pytest
from openai import APIStatusError, AsyncOpenAI, OpenAI

from tests.helpers import build_cli
from tests.serve.server_process import ServerProcess

TEMPLATE = Path(__file__).with_name("chatml_tools.jinja")
CONTEXT = 2048  # room for long generations: the disconnect tests must outlast their clients
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def run_dir():
    m = build_cli("tiny_llama_offgraph", "export.logits_mode=full", f"export.max_context_len={CONTEXT}",
                  "export.prefill_chunk=32", "verify.enabled=false")
    return m["stdout"].strip().splitlines()[-1].split(": ", 1)[1]


@pytest.fixture(scope="module")
def server(run_dir):
    s = ServerProcess("--run", run_dir, "--chat-template", str(TEMPLATE), "--sessions", "8")
    yield s
    s.stop()
    assert "Traceback" not in s.text, s.text[-5000:]


@pytest.fixture()
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, messages=ASK, **kw):
    kw.setdefault("model", "tiny-llama")
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(messages=messages, **kw)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    chat(client)
    text = httpx.get(server.url + "/metrics").text
    for name in ("pipeline_requests_total", "pipeline_queue_depth", "pipeline_sessions_active",
                 "pipeline_decode_tokens_per_second", "pipeline_prefix_cache_hits_total"):
        assert f"# TYPE {name} " in text
    assert re.search(r'pipeline_requests_total\{route="chat",status="200"\} [1-9]', text)


def test_streamed_answer_equals_the_plain_one(client):
    plain = chat(client, max_tokens=32)
    chunks = list(chat(client, max_tokens=32, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    again = chat(client, max_tokens=32)
    assert again.choices[0].message.content == plain.choices[0].message.content


def test_json_schema_answers_parse(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"]}
    # ignore_eos: the answer still ends where the grammar does
    for temperature, ignore_eos in ((0, False), (1.0, False), (0, True)):
        r = chat(client, [{"role": "user", "content": "A person as JSON."}], max_tokens=200, temperature=temperature,
                 seed=3, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
                 extra_body={"ignore_eos": ignore_eos}, timeout=60)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_parse(client, choice):
    r = chat(client, tools=WEATHER, tool_choice=choice, max_tokens=200)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for call in msg.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in msg.tool_calls} == {"get_time"}
    # the call in the next turn's history, the tool's answer after it: the template renders both
    follow = ASK + [msg.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    assert chat(client, follow, tools=WEATHER, tool_choice="none").choices[0].message.content is not None


def test_n_seed_stop_and_completions(client):
    a = chat(client, temperature=1.0, n=3, seed=11)
    b = chat(client, temperature=1.0, n=3, seed=11)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice samples with a seed of its own
    assert a.usage.prompt_tokens == chat(client).usage.prompt_tokens  # the prompt counted once
    full = chat(client, max_tokens=32).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = chat(client, max_tokens=32, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]
    r = client.completions.create(model="tiny-llama", prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    ids = client.completions.create(model="tiny-llama", prompt=[1, 5, 9, 33], max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 5


def test_eight_concurrent_requests_equal_their_serial_answers(server, client):
    prompts = [[{"role": "user", "content": f"Count to {i} please."}] for i in range(8)]
    serial = [chat(client, p, max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
              for p in prompts]

    async def together():
        ac = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        rs = await asyncio.gather(*(ac.chat.completions.create(model="tiny-llama", messages=p, temperature=0,
                                                               max_tokens=40, extra_body={"ignore_eos": True})
                                    for p in prompts))
        return [r.choices[0].message.content for r in rs]
    assert asyncio.run(together()) == serial


def test_a_second_turn_prefills_only_what_is_new(client):
    history = [{"role": "user", "content": "Tell me about the sea, the tide and the wind."}]
    first = chat(client, history, max_tokens=16)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the gulls?"}]
    second = chat(client, history, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_requests_get_openai_errors_and_the_next_request_is_answered(server, client):
    url = server.url + "/v1/chat/completions"
    good = {"model": "tiny-llama", "messages": ASK, "max_tokens": 4}
    assert error_of(httpx.post(url, content=b"{not json"), 400)["code"] == "invalid_json"
    for field, value in [("messages", "hi"), ("temperature", "hot"), ("n", 0), ("max_tokens", -1), ("stop", 5),
                         ("stream", "yes"), ("messages", [{"role": "robot", "content": "x"}]), ("top_p", 3),
                         ("response_format", {"type": "xml"}), ("tools", [{"type": "function"}]),
                         ("tool_choice", "required"), ("logprobs", True)]:
        err = error_of(httpx.post(url, json={**good, field: value}), 400)
        assert field in (err["param"] or "") + err["message"], (field, err)
    assert error_of(httpx.post(url, json={**good, "model": "gpt-9"}), 404)["code"] == "model_not_found"
    long = [{"role": "user", "content": "fox " * (CONTEXT * 2)}]
    assert error_of(httpx.post(url, json={**good, "messages": long}), 413)["code"] == "context_length_exceeded"
    assert error_of(httpx.post(url, json={**good, "max_tokens": CONTEXT}), 400)["param"] == "max_tokens"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    assert error_of(httpx.post(url, json={**good, "response_format": bad_schema}), 400)["code"] == "invalid_schema"
    assert error_of(httpx.get(server.url + "/v1/nothing"), 404)
    assert error_of(httpx.get(url), 405)
    with pytest.raises(APIStatusError) as e:
        chat(client, model="other")
    assert e.value.status_code == 404
    assert chat(client, max_tokens=4).choices[0].message.content is not None


def test_a_full_queue_answers_429(run_dir):
    s = ServerProcess("--run", run_dir, "--chat-template", str(TEMPLATE), "--sessions", "1", "--queue", "1")
    try:
        url = s.url + "/v1/chat/completions"
        body = {"model": "tiny-llama", "messages": ASK, "max_tokens": 900, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(http.post(url, json=body) for _ in range(8)))
        rs = asyncio.run(burst())
        codes = sorted(r.status_code for r in rs)
        assert set(codes) == {200, 429} and codes.count(200) >= 2, codes  # a session and a place in the queue
        busy = next(r for r in rs if r.status_code == 429)
        assert error_of(busy, 429)["code"] == "queue_full" and busy.headers["retry-after"]
        assert error_of(httpx.post(url, json={**body, "n": 3}), 400)["param"] == "n"  # could never fit
        assert httpx.post(url, json={**body, "max_tokens": 4}, timeout=60).status_code == 200
    finally:
        s.stop()
    assert "Traceback" not in s.text


def wait_idle(server, seconds=20) -> bool:
    end = time.time() + seconds
    while time.time() < end:
        if re.search(r"^pipeline_sessions_active 0$", httpx.get(server.url + "/metrics").text, re.M):
            return True
        time.sleep(0.2)
    return False


def completion_tokens(server) -> int:
    return int(re.search(r"^pipeline_completion_tokens_total (\d+)$", httpx.get(server.url + "/metrics").text,
                         re.M).group(1))


def test_a_client_that_goes_away_cancels_its_request(server):
    url = server.url + "/v1/chat/completions"
    # 8 choices of 1900 tokens: seconds of work, of which a client that goes away at once must cost little
    body = {"model": "tiny-llama", "messages": ASK, "max_tokens": 1900, "n": 8, "ignore_eos": True,
            "temperature": 0}
    before = completion_tokens(server)
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        next(r.iter_lines())
    assert wait_idle(server)
    streamed = completion_tokens(server) - before
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=0.1)
    assert wait_idle(server)
    plain = completion_tokens(server) - before - streamed
    assert streamed < 8 * 1900 / 2 and plain < 8 * 1900 / 2, (streamed, plain)
    assert httpx.post(url, json={**body, "max_tokens": 3, "n": 1}, timeout=60).status_code == 200


def fuzz_bodies(rng: random.Random, n: int):
    good = {"model": "tiny-llama", "messages": ASK, "max_tokens": 2}
    values = [None, True, -1, 0, 2**70, 1e308, float("nan"), "", "x" * 5000, [], {}, [[[]]], {"a": {"b": []}},
              [{"role": "user"}], [{"content": "x"}], {"type": "json_schema"}, "\udcff"]
    keys = list(good) + ["temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "response_format", "tools",
                         "tool_choice", "prompt", "stream_options", "max_completion_tokens", "ignore_eos"]
    for i in range(n):
        kind = i % 6
        if kind == 0:
            body = dict(good)
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(keys)] = rng.choice(values)
            yield json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        elif kind == 1:
            raw = json.dumps(good).encode()
            k = rng.randrange(len(raw))
            yield raw[:k] + bytes([rng.randrange(256)]) + raw[k + 1:]
        elif kind == 2:
            yield bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        elif kind == 3:
            depth = rng.choice([10, 1000, 100000])
            yield b"[" * depth + b"]" * depth
        elif kind == 4:
            yield json.dumps({**good, "messages": [{"role": "user", "content": "y" * rng.choice([10, 10**5])}] *
                              rng.choice([1, 50])}).encode()
        else:
            yield json.dumps(rng.choice([[], "x", 3, None, good["messages"]])).encode()


def test_fuzz_malformed_and_oversized_requests(server, client):
    rng = random.Random(1234)
    statuses = {}

    async def blast():
        async with httpx.AsyncClient(timeout=60) as http:
            sem = asyncio.Semaphore(16)

            async def one(body, path):
                async with sem:
                    r = await http.post(server.url + path, content=body,
                                        headers={"content-type": "application/json"})
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    if r.status_code >= 400:
                        assert r.json()["error"]["message"]
            paths = ["/v1/chat/completions", "/v1/completions"]
            await asyncio.gather(*(one(b, paths[i % 2]) for i, b in enumerate(fuzz_bodies(rng, 2400))))
            big = await http.post(server.url + "/v1/chat/completions", content=b"[" + b"1," * (3 << 20) + b"1]")
            assert big.status_code == 413
    asyncio.run(blast())
    assert not any(s >= 500 for s in statuses), statuses
    assert sum(statuses.values()) == 2400
    assert chat(client, max_tokens=4).choices[0].message.content is not None
    assert wait_idle(server)
    assert "Traceback" not in server.text
