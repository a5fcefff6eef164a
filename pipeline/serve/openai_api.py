"""The OpenAI request bodies, read and checked before any work: each refusal is an ApiError that names the field, the
value and what is allowed, answered as OpenAI's error object ({"error": {"message", "type", "param", "code"}})."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_N = 8            # choices per request
MAX_STOP = 4         # stop strings, as OpenAI allows
MAX_SEED = 2**63 - 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                             429: "rate_limit_exceeded", 503: "server_error", 504: "timeout"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """What one request asks for, the chat and the completion endpoints alike."""
    model: str
    prompts: list                     # chat: [messages]; completions: a str or a list of ids per prompt
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False       # stream_options.include_usage
    schema: Any = None                # response_format's JSON schema (True: any JSON object)
    tools: Optional[list[dict]] = None
    tool_choice: Any = "auto"         # "auto" | "none" | "required" | a function's name
    chat: bool = True
    ignore_eos: bool = False          # not OpenAI's (vLLM's and llama.cpp's): the whole max_tokens, for benchmarks


def _type_name(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _get(body: dict, key: str, kinds: tuple, default=None, allowed: str = ""):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        want = allowed or " or ".join(_type_name(k()) if k is not type(None) else "null" for k in kinds)
        raise ApiError(400, f"'{key}' must be {want}, got {_type_name(v)}: {json.dumps(v)[:80]}", key,
                       "invalid_type")
    return v


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = _get(body, key, (int, float), default, "a number")
    if not lo <= v <= hi:
        raise ApiError(400, f"'{key}' is {v}: it must be in [{lo}, {hi}]", key, "invalid_value")
    return float(v)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_json")
    return body


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty array of messages", "messages",
                       "invalid_type" if msgs is not None else "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object, got {_type_name(m)}", where, "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"'{where}.role' is {json.dumps(role)}: one of system, developer, user, assistant, "
                           "tool", f"{where}.role", "invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"'{where}.content[{j}]' must be a text part ({{\"type\": \"text\", "
                                   "\"text\": ...}}): this model reads text only", f"{where}.content", "invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"'{where}.content' must be a string or an array of text parts, got "
                           f"{_type_name(content)}", f"{where}.content", "invalid_type")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _assistant_tool_calls(m["tool_calls"], where)
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _assistant_tool_calls(calls, where: str) -> list[dict]:
    """An earlier turn's calls as the chat templates read them: arguments as an object, not a JSON string."""
    if not isinstance(calls, list):
        raise ApiError(400, f"'{where}.tool_calls' must be an array", f"{where}.tool_calls", "invalid_type")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"'{where}.tool_calls[{k}]' must be {{\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"arguments\": ...}}", f"{where}.tool_calls", "invalid_value")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise ApiError(400, f"'{where}.tool_calls[{k}].function.arguments' is not JSON",
                               f"{where}.tool_calls", "invalid_value") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _response_format(body: dict):
    rf = _get(body, "response_format", (dict,), None)
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return True
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema' object",
                           "response_format", "invalid_value")
        return js.get("schema", {})
    raise ApiError(400, f"'response_format.type' is {json.dumps(kind)}: one of text, json_object, json_schema",
                   "response_format", "invalid_value")


def _tools(body: dict):
    tools = _get(body, "tools", (list,), None)
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"parameters\": {...}}}}", "tools", "invalid_value")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ApiError(400, f"'tools[{i}].function.parameters' must be a JSON schema object", "tools",
                           "invalid_value")
    return tools


def _tool_choice(body: dict, tools):
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ApiError(400, "'tool_choice' is \"required\" but no 'tools' were given", "tool_choice",
                           "invalid_value")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, f"'tool_choice' is {json.dumps(choice)[:80]}: one of \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice", "invalid_value")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise ApiError(400, f"'tool_choice' names function {name!r}, which is not in 'tools'", "tool_choice",
                       "invalid_value")
    return name


def parse(body: dict, chat: bool) -> Params:
    unsupported = [k for k in ("logprobs", "top_logprobs", "echo", "suffix", "best_of", "logit_bias", "audio",
                               "modalities", "prediction")
                   if body.get(k) not in (None, False, 1 if k == "best_of" else None)]
    if unsupported:
        raise ApiError(400, f"'{unsupported[0]}' is not supported by this server", unsupported[0], "unsupported")
    model = _get(body, "model", (str,), "")
    if chat:
        prompts = [_messages(body)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string, an array of strings or an array of token ids", "prompt",
                           "invalid_type" if prompt is not None else "missing_required_parameter")
    max_tokens = _get(body, "max_completion_tokens", (int,), None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", (int,), None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'max_tokens' is {max_tokens}: it must be at least 1", "max_tokens", "invalid_value")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > MAX_STOP):
        raise ApiError(400, f"'stop' must be a non-empty string or an array of at most {MAX_STOP} of them", "stop",
                       "invalid_value")
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' is {n}: it must be in [1, {MAX_N}]", "n", "invalid_value")
    seed = _get(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"'seed' is {seed}: it must be in [0, 2^63 - 1]", "seed", "invalid_value")
    top_k = _get(body, "top_k", (int,), 0)
    if top_k < 0:
        raise ApiError(400, f"'top_k' is {top_k}: it must be at least 0 (0 = off)", "top_k", "invalid_value")
    stream_options = _get(body, "stream_options", (dict,), {})
    tools = _tools(body) if chat else None
    p = Params(model=model, prompts=prompts, max_tokens=max_tokens,
               temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
               top_k=top_k, seed=seed, n=n, stop=stop or [], stream=bool(_get(body, "stream", (bool,), False)),
               include_usage=bool(stream_options.get("include_usage")),
               schema=_response_format(body) if chat else None, tools=tools,
               tool_choice=_tool_choice(body, tools) if chat else "none", chat=chat,
               ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)))
    if p.top_p == 0.0:
        p.temperature = 0.0  # nothing but the top token
    return p
