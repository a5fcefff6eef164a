"""The ASGI application: the OpenAI routes, /health and /metrics, over one engine (engine.py). A request is read and
checked whole before anything is submitted (openai_api.py); the queue is bounded (429 when full); a client that goes
away, or a request past its timeout, cancels its choices in the engine."""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import Counter, OrderedDict
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.serve import tool_calls
from pipeline.serve.engine import Engine, EngineError, Sampling
from pipeline.serve.generation import Choice, GenerationError, merged
from pipeline.serve.openai_api import ApiError, Params, parse, parse_json

MAX_BODY = 4 << 20  # bytes of a request body


class Server:
    """What the routes share: the engine, the tokenizer, the queue's bound and the counters /metrics reports."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, *, queue: int, timeout: float,
                 speculate: bool):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        info = engine.info
        self.vocab, self.context = info["vocab"], info["max_session_tokens"]
        self.stop_ids = set(info["stops"])
        self.limit = info["max_decode_sequences"] + queue  # choices running and waiting
        self.timeout, self.speculate = timeout, speculate
        self.tool_format = tool_calls.tool_format(getattr(tokenizer, "chat_template", None))
        self.special_ids = {t: i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids)}
        self.special_ids.update({t.content: i for i, t in tokenizer.added_tokens_decoder.items()})
        self.lltok = None
        self.grammars: OrderedDict[str, str] = OrderedDict()
        self.inflight = 0
        self.requests: Counter = Counter()  # (route, status)
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.created = int(time.time())

    # --- prompts -------------------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], tools) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages", "unsupported")
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (roles out of order, ...) is the user's
            raise ApiError(400, f"the chat template refused these messages: {str(e).splitlines()[0]}", "messages",
                           "invalid_value") from None
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tok(prompt, add_special_tokens=True)["input_ids"]
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"'prompt' holds token id {bad[0]}, outside the vocabulary [0, {self.vocab})",
                           "prompt", "invalid_value")
        return list(prompt)

    def room(self, ids: list[int], max_tokens: Optional[int]) -> int:
        if len(ids) >= self.context:
            raise ApiError(413, f"the prompt has {len(ids)} tokens; the context holds {self.context}, with at least "
                           "one for the reply", "messages", "context_length_exceeded")
        left = self.context - len(ids)
        if max_tokens is not None and max_tokens > left:
            raise ApiError(400, f"'max_tokens' is {max_tokens}, but the prompt's {len(ids)} tokens leave {left} of "
                           f"the context's {self.context}", "max_tokens", "context_length_exceeded")
        return max_tokens or left

    # --- grammars ------------------------------------------------------------------------------------------------
    def constraint(self, p: Params, fmt):
        """The grammar state of one choice: response_format's schema, or the tool-call format; None if free."""
        forced_tool = p.tools and p.tool_choice not in ("auto", "none")
        if p.schema is None and not forced_tool:
            return None
        from pipeline.generation.constrain import Constraint, ConstraintError, grammar_for_schema, tokenizer_for
        if self.lltok is None:
            self.lltok = tokenizer_for(self.tok, self.vocab)
        if forced_tool:
            key = "tools:" + json.dumps([p.tools, p.tool_choice], sort_keys=True)
        else:
            key = "schema:" + json.dumps(p.schema, sort_keys=True)
        grammar = self.grammars.get(key)
        try:
            if grammar is None:
                if forced_tool:
                    import llguidance
                    grammar = llguidance.LLMatcher.grammar_from_lark(
                        tool_calls.lark_grammar(p.tools, p.tool_choice, fmt, self.special_ids))
                    error = llguidance.LLMatcher.validate_grammar(grammar)
                    if error:
                        raise ConstraintError(f"'tools': a parameters schema the grammar engine refuses: {error}")
                else:
                    grammar = grammar_for_schema({"type": "object"} if p.schema is True else p.schema,
                                                 "'response_format'")
                self.grammars[key] = grammar
                if len(self.grammars) > 64:
                    self.grammars.popitem(last=False)
            return Constraint(grammar, self.lltok, self.vocab)
        except ConstraintError as e:
            raise ApiError(400, str(e), "tools" if forced_tool else "response_format", "invalid_schema") from None

    # --- choices -------------------------------------------------------------------------------------------------
    def start(self, p: Params) -> list[Choice]:
        """Every choice of the request submitted (n per prompt), after every check."""
        fmt = tool_calls.require_format(self.tok.chat_template, p.tools) if p.tool_choice != "none" else None
        prompts = [self.chat_ids(m, p.tools) for m in p.prompts] if p.chat else [self.prompt_ids(x) for x in p.prompts]
        budgets = [self.room(ids, p.max_tokens) for ids in prompts]
        want = len(prompts) * p.n
        if not self.engine.alive:
            raise ApiError(503, "the engine has exited; restart the server", None, "engine_down")
        if want > self.limit:
            raise ApiError(400, f"'n' asks for {want} choices; this server runs and queues at most {self.limit}", "n",
                           "invalid_value")
        if self.inflight + want > self.limit:
            raise ApiError(429, f"the server is busy: {self.inflight} choices running or queued, at most "
                           f"{self.limit}; retry later", None, "queue_full")
        constraints = [self.constraint(p, fmt) for _ in range(want)]
        choices = []
        for k, (ids, budget) in enumerate((ids, b) for ids, b in zip(prompts, budgets) for _ in range(p.n)):
            seed = None if p.seed is None else (p.seed + k) % 2**63
            s = Sampling(max_tokens=budget, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
                         speculate=self.speculate, ignore_eos=p.ignore_eos)
            choices.append(Choice(self.engine, ids, s, lambda x: self.tok.decode(x, skip_special_tokens=True),
                                  self.stop_ids, p.stop, constraints[k]))
        self.inflight += len(choices)
        return choices

    def finished(self, choices: list[Choice], n: int) -> dict:
        """The request's usage (its prompts counted once, not once per choice), added to the counters."""
        self.inflight -= len(choices)
        prompt = sum(c.prompt_tokens for c in choices[::n])
        out = {"prompt_tokens": prompt, "completion_tokens": sum(c.generated for c in choices),
               "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)}}
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        self.prompt_tokens += prompt
        self.cached_tokens += out["prompt_tokens_details"]["cached_tokens"]
        self.completion_tokens += out["completion_tokens"]
        return out


def _message(c: Choice, p: Params, fmt) -> tuple[dict, str]:
    """The assistant message of a finished chat choice and its finish_reason (tool calls read from the text)."""
    calls = tool_calls.parse_calls(c.text, fmt, p.tools) if fmt is not None and p.tools else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": c.text}, c.finish_reason or "stop"


async def _all_or_nothing(tasks: list[asyncio.Task], gone: asyncio.Future, timeout: float) -> Optional[str]:
    """None once every task has ended; "gone" if the client went away first, "timeout" if the time ran out."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    pending = set(tasks)
    while pending:
        if loop.time() >= end:
            return "timeout"
        done, pending = await asyncio.wait(pending | {gone}, timeout=end - loop.time(),
                                           return_when=asyncio.FIRST_COMPLETED)
        if gone in done:
            return "gone"
        pending.discard(gone)
    return None


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request) -> dict:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"the request body is {size} bytes, more than {MAX_BODY}", None, "body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY:
            raise ApiError(413, f"the request body is more than {MAX_BODY} bytes", None, "body_too_large")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def make_app(server: Server) -> Starlette:
    async def generate(request: Request, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        status = 200
        try:
            p = parse(await _read_body(request), chat)
            if p.model and p.model != server.model_name:
                raise ApiError(404, f"the model {p.model!r} does not exist: this server serves "
                               f"{server.model_name!r}", "model", "model_not_found")
            choices = server.start(p)
        except ApiError as e:
            server.requests[(route, e.status)] += 1
            return JSONResponse(e.body(), e.status, headers={"Retry-After": "1"} if e.status == 429 else None)
        fmt = server.tool_format if p.tools and p.tool_choice != "none" else None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if p.stream:
            server.requests[(route, 200)] += 1
            events = _stream(server, p, choices, fmt, rid, chat)
            # started here, so that its cleanup runs (asyncio closes a started generator that is dropped) even if
            # the client is gone before the response begins
            first = await events.__anext__()
            return StreamingResponse(_chained(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        tasks = [asyncio.ensure_future(c.run()) for c in choices]
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            ended = await _all_or_nothing(tasks, gone, server.timeout)
            if ended == "gone":  # nobody to answer
                status = 499
                return Response(status_code=499)
            if ended == "timeout":
                status = 504
                return JSONResponse(ApiError(504, f"the request took longer than {server.timeout:g} s",
                                             None, "timeout").body(), 504)
            failed = next((t.exception() for t in tasks if t.exception() is not None), None)
            if failed is not None:
                if not isinstance(failed, (GenerationError, EngineError)):
                    raise failed
                status = 500
                return JSONResponse(ApiError(500, f"generation failed: {failed}", None, "engine_error").body(), 500)
        finally:
            gone.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(gone, *tasks, return_exceptions=True)
            usage = server.finished(choices, p.n)
            server.requests[(route, status)] += 1
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": server.model_name, "usage": usage}
        if chat:
            body["choices"] = [dict(zip(("message", "finish_reason"), _message(c, p, fmt)), index=i, logprobs=None)
                               for i, c in enumerate(choices)]
        else:
            body["choices"] = [{"text": c.text, "index": i, "logprobs": None, "finish_reason": c.finish_reason}
                               for i, c in enumerate(choices)]
        return JSONResponse(body)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, True)

    async def completions(request: Request) -> Response:
        return await generate(request, False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                          "created": server.created, "owned_by": "pipeline"}]})

    async def health(request: Request) -> Response:
        if not server.engine.alive:
            return JSONResponse({"status": "engine exited"}, 503)
        return JSONResponse({"status": "ok", "model": server.model_name})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(await _metrics(server), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                                     "not_found" if exc.status_code == 404 else "method_not_allowed").body(),
                            exc.status_code)

    async def server_error(request: Request, exc: Exception) -> Response:
        print(f"[serve] error: {request.method} {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), 500)

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health, methods=["GET"]),
                             Route("/metrics", metrics, methods=["GET"])],
                     exception_handlers={HTTPException: http_error, Exception: server_error})


async def _chained(first: str, rest):
    yield first
    async for event in rest:
        yield event


def _chunk(rid: str, model: str, chat: bool, choices: list[dict], usage=None) -> str:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


async def _stream(server: Server, p: Params, choices: list[Choice], fmt, rid: str, chat: bool):
    """Server-sent events: a role chunk per choice, its text as it comes (tool calls at the end: a call is only
    known once its text parses), its finish_reason, usage if asked, then [DONE]."""
    model = server.model_name
    held = fmt is not None  # with tools, a choice's text is only known to be a reply or a call at its end
    try:
        if chat:
            for i in range(len(choices)):
                yield _chunk(rid, model, chat, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}])
        async with asyncio.timeout(server.timeout):
            async for i, piece in merged(choices):
                c = choices[i]
                if piece is not None and not held:
                    delta = {"index": i, "delta": {"content": piece}, "logprobs": None, "finish_reason": None} \
                        if chat else {"index": i, "text": piece, "logprobs": None, "finish_reason": None}
                    yield _chunk(rid, model, chat, [delta])
                elif piece is None:
                    if chat and held:
                        msg, reason = _message(c, p, fmt)
                        delta = {k: v for k, v in msg.items() if k != "role"}
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [dict(tc, index=k) for k, tc in enumerate(delta["tool_calls"])]
                    else:
                        delta, reason = {}, c.finish_reason
                    end = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason} if chat else \
                        {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
                    yield _chunk(rid, model, chat, [end])
    except TimeoutError:
        yield f"data: {json.dumps(ApiError(504, f'the request took longer than {server.timeout:g} s').body())}\n\n"
    except (GenerationError, EngineError) as e:
        yield f"data: {json.dumps(ApiError(500, f'generation failed: {e}', None, 'engine_error').body())}\n\n"
    finally:
        for c in choices:
            c.cancel()
        usage = server.finished(choices, p.n)
    if p.include_usage:
        yield _chunk(rid, model, chat, [], usage)
    yield "data: [DONE]\n\n"


async def _metrics(server: Server) -> str:
    """Prometheus text format: the server's counters and the engine's."""
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

    metric("pipeline_requests_total", "counter", "HTTP requests answered, by route and status",
           [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(server.requests.items())] or [("", 0)])
    metric("pipeline_prompt_tokens_total", "counter", "prompt tokens of the answered choices",
           [("", server.prompt_tokens)])
    metric("pipeline_prompt_tokens_cached_total", "counter", "prompt tokens resumed from the prefix cache",
           [("", server.cached_tokens)])
    metric("pipeline_completion_tokens_total", "counter", "tokens generated", [("", server.completion_tokens)])
    try:
        st = await server.engine.stats()
    except (EngineError, asyncio.TimeoutError):
        st = None
    if st:
        metric("pipeline_sessions_active", "gauge", "sessions in the running batch", [("", st["active"])])
        metric("pipeline_queue_depth", "gauge", "requests waiting for a session", [("", st["queued"])])
        tok_s = st["decode_tokens"] * 1000.0 / st["decode_ms"] if st["decode_ms"] else 0.0
        metric("pipeline_decode_tokens_per_second", "gauge", "decode tokens per second of forward time, all sessions",
               [("", tok_s)])
        metric("pipeline_forwards_total", "counter", "engine forwards", [("", st["forwards"])])
        pc = st["prefix_cache"]
        metric("pipeline_prefix_cache_lookups_total", "counter", "prefix-cache lookups", [("", pc["lookups"])])
        metric("pipeline_prefix_cache_hits_total", "counter", "prefix-cache hits", [("", pc["hits"])])
    metric("pipeline_engine_up", "gauge", "1 while the engine runs", [("", 1 if server.engine.alive else 0)])
    return "\n".join(lines) + "\n"
