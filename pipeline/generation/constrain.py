"""Schema- and grammar-constrained output (`--json-schema FILE`, `--grammar FILE`): llguidance over the tokenizer the
build recorded. Each token is drawn from the logits with every token the grammar refuses masked out, so the output
always parses; a speculative draft is cut at its first token the grammar refuses before it is verified.

Why llguidance: bench/grammar_engines.py measures the per-token mask time of llguidance, xgrammar and outlines-core
over SmolLM2's and Gemma 3's vocabularies (docs/speculation-and-grammars.md); llguidance needs no other package
(xgrammar pulls torch's triton), takes JSON schemas, Lark and GBNF, and checks a draft in one call.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch


class ConstraintError(ValueError):
    """A schema or grammar that cannot be used: the file, and what is wrong with it."""


def _engine():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as e:  # the `constrain` extra
        raise ConstraintError("--json-schema / --grammar need llguidance: pip install -e '.[constrain]'") from e
    return llguidance


def grammar_text(json_schema: Optional[Path] = None, grammar: Optional[Path] = None) -> str:
    """The llguidance grammar of a JSON schema file, or of a grammar file (GBNF when it has `::=`, else Lark)."""
    llg = _engine()
    path = Path(json_schema or grammar)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConstraintError(f"{'--json-schema' if json_schema else '--grammar'} {path}: {e.strerror}") from e
    if json_schema:
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise ConstraintError(f"--json-schema {path}: not JSON ({e})") from e
        return grammar_for_schema(schema, f"--json-schema {path}")
    else:
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            lark = gbnf_to_lark(text) if "::=" in text else text
        except Exception as e:  # noqa: BLE001 - the converter's own message says what is wrong
            raise ConstraintError(f"--grammar {path}: not a GBNF grammar ({e})") from e
        try:
            grm = llg.LLMatcher.grammar_from_lark(lark)
        except ValueError as e:
            raise ConstraintError(f"--grammar {path}: {e}") from e
    error = llg.LLMatcher.validate_grammar(grm)
    if error:
        raise ConstraintError(f"{'--json-schema' if json_schema else '--grammar'} {path}: {error}")
    return grm


def grammar_for_schema(schema, where: str) -> str:
    """The llguidance grammar of a JSON schema (a dict or a bool); `where` names it in errors."""
    llg = _engine()
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{where}: a schema is a JSON object, got {type(schema).__name__}")
    # compact JSON unless the schema's own x-guidance says otherwise: whitespace a model may pad without end is
    # tokens spent and a budget that can run out before the closing brace
    try:
        grm = llg.LLMatcher.grammar_from_json_schema(closed(schema), defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, RecursionError) as e:
        raise ConstraintError(f"{where}: {e}") from e
    error = llg.LLMatcher.validate_grammar(grm)
    if error:
        raise ConstraintError(f"{where}: {error}")
    return grm


# keywords whose value is a schema, a list of schemas, or a map of names to schemas (the rest hold data: enum, const,
# default, examples)
SUBSCHEMA = {"items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
             "unevaluatedProperties", "unevaluatedItems", "propertyNames"}
SUBSCHEMAS = {"prefixItems", "anyOf", "oneOf", "allOf"}
NAMED_SUBSCHEMAS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
# beside these an object's properties come from elsewhere too: closing it would refuse them
COMPOSED = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref",
            "if", "dependentSchemas"}


SAFE_INTEGER = 2**53 - 1  # RFC 7493 (I-JSON): the integers every JSON parser reads exactly


def closed(schema, open_here: bool = False):
    """The schema with each object that names its properties closed to others (`additionalProperties: false`) unless
    it says otherwise, as OpenAI's structured outputs and xgrammar read a schema: JSON Schema leaves them open, and a
    model then adds keys until its token limit. An object that names none ({"type": "object"}) stays open, and so
    does one composed with others (allOf and the like): its properties come from more than one place. An integer
    without bounds gets I-JSON's (RFC 7493), so that its digits end."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in SUBSCHEMA:
            out[k] = closed(v)
        elif k in SUBSCHEMAS and isinstance(v, list):
            out[k] = [closed(s, open_here=k == "allOf") for s in v]
        elif k in NAMED_SUBSCHEMAS and isinstance(v, dict):
            out[k] = {name: closed(s) for name, s in v.items()}
        else:
            out[k] = v
    names_all = set(out.get("required") or []) <= set(out.get("properties") or {})  # else it relies on others
    if "properties" in out and not open_here and not COMPOSED & out.keys() and names_all:
        out["additionalProperties"] = False
    if out.get("type") == "integer":  # digits without end otherwise (a small model repeats one); I-JSON's range
        out.setdefault("minimum", -SAFE_INTEGER)
        out.setdefault("maximum", SAFE_INTEGER)
    return out


def tokenizer_for(hf_tokenizer, vocab_size: int):
    """llguidance's view of the build's tokenizer, over the program's vocabulary (it may be padded)."""
    llg = _engine()
    return llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


class Constraint:
    """One generation's grammar state: masks logits, takes the tokens chosen, checks drafts, rolls back."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int):
        llg = _engine()
        self._torch = llg.torch
        self.matcher = llg.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())
        self.vocab = vocab_size
        self.bitmask = llg.torch.allocate_token_bitmask(1, vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        # the first mask builds the grammar's lexer over the vocabulary (up to a second or two): here, not at the
        # first token
        llg.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        self.mask_s = 0.0  # time spent computing masks
        self.masks = 0

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token the grammar refuses here at -inf (a copy)."""
        import time
        t0 = time.perf_counter()
        self._torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        # the bits unpacked here: llguidance's apply_token_bitmask_inplace is a torch.compile'd kernel (seconds to
        # compile at its first call)
        allowed = ((self.bitmask[0].unsqueeze(1) >> self._shifts) & 1).flatten()[:logits.numel()].bool()
        out = logits.float().masked_fill(~allowed, float("-inf"))
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return out

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintError(f"token {token} refused by the grammar: {self.matcher.get_error()}")

    def valid_prefix(self, draft: list[int]) -> list[int]:
        """The draft up to its first token the grammar refuses (nothing is consumed)."""
        return draft[:self.matcher.validate_tokens(list(draft))] if draft else []

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar: it may end here (a token limit there loses nothing)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()

    def stats(self) -> dict:
        return {"masks": self.masks, "mask_ms_per_token": round(self.mask_s * 1e3 / max(self.masks, 1), 3)}
