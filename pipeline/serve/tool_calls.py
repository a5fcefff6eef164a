"""Tool calls in the model's own format, read from its chat template: the families whose template renders `tools`
and how their replies call them. tool_choice "required" or a named function generates the call under a grammar of that
format (so it parses); "auto" lets the model choose and reads a call out of the text if it made one."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from pipeline.generation.constrain import closed
from pipeline.serve.openai_api import ApiError


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str    # before each call's JSON ("" when the reply is the JSON itself)
    close: str
    args_key: str  # the key of the arguments in the call's JSON


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")  # Qwen2.5, Qwen3, Hermes, SmolLM3
LLAMA3 = ToolFormat("llama3-json", "", "", "parameters")  # Llama 3.1 / 3.2: the reply is {"name", "parameters"}


def tool_format(chat_template: Optional[str]) -> Optional[ToolFormat]:
    """The template's tool-call format, or None when it renders no tools."""
    t = chat_template or ""
    if "tools" not in t:
        return None
    if "<tool_call>" in t:
        return HERMES
    if '"parameters"' in t and "ipython" in t:
        return LLAMA3
    return None


def call_schema(tools: list[dict], choice, fmt: ToolFormat) -> dict:
    """A JSON schema of one call: the name of a tool (the named one under tool_choice={function}) and its
    parameters' schema."""
    picks = [t["function"] for t in tools if choice in ("required", "auto") or t["function"]["name"] == choice]
    # compact JSON, as response_format's (pipeline/generation/constrain.py): padding is tokens spent
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               fmt.args_key: closed(f.get("parameters") or {"type": "object"})},
              "required": ["name", fmt.args_key], "additionalProperties": False} for f in picks]
    return {"x-guidance": {"whitespace_flexible": False}, "anyOf": calls}


def lark_grammar(tools: list[dict], choice, fmt: ToolFormat, special_ids: dict[str, int]) -> str:
    """llguidance Lark: one or more calls (one for a named function), each its tags around a JSON of call_schema.
    A tag that is one special token of the vocabulary is matched as that token."""
    def literal(text: str) -> str:
        parts = []
        for piece in re.split(r"(<[^<>\s]+>)", text):
            if not piece:
                continue
            if piece in special_ids:
                parts.append(f"<[{special_ids[piece]}]>")
            else:
                parts.append(json.dumps(piece))
        return " ".join(parts) or '""'
    call = f"{literal(fmt.open)} call_json {literal(fmt.close)}" if fmt.open else "call_json"
    many = "call_one" if choice not in ("required",) or not fmt.open else 'call_one ("\\n" call_one)*'
    return (f"start: {many}\ncall_one: {call}\n"
            f"call_json: %json {json.dumps(call_schema(tools, choice, fmt))}\n")


def parse_calls(text: str, fmt: ToolFormat, tools: list[dict]) -> Optional[list[dict]]:
    """The calls in a reply (OpenAI's tool_calls, arguments as a JSON string), or None when it holds none that parse
    and name a given tool."""
    names = {t["function"]["name"] for t in tools}
    if fmt.open:
        bodies = re.findall(re.escape(fmt.open.strip()) + r"\s*(.*?)\s*" + re.escape(fmt.close.strip()), text, re.S)
    else:
        bodies = [text.strip()]
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get(fmt.args_key, obj.get("arguments", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})
    return calls or None


def require_format(chat_template: Optional[str], tools) -> Optional[ToolFormat]:
    if not tools:
        return None
    fmt = tool_format(chat_template)
    if fmt is None:
        raise ApiError(400, "'tools': this model's chat template has no tool-call format (it does not render "
                       "tools), so its replies cannot call them", "tools", "unsupported")
    return fmt
