"""Which (scheme, group) each weight takes: the precedence, written once. The quantize stage, the target-bits
allocator, calibrate, preflight and the memory estimate all ask here.

A linear takes the first of:
  1. quantize.lm_head, for the output projection, when it is set;
  2. the first quantize.overrides entry that matches it, by name pattern or by role (the role itself, or a fused
     linear that holds it);
  3. none (float), when its role stays float (pipeline/model/archs FLOAT_ROLES: a shared expert's gate);
  4. the allocator's plan (quantize.target_bpw), for the linears the plan moves;
  5. quantize.linear.
The embedding takes quantize.embedding. Group 0 is one scale per output row.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Optional

from pipeline.model import archs
from pipeline.model.quant.schemes import SCHEMES
from pipeline.registry import v

# what decided a choice; the allocator moves the linears that only the two last steps decide
MOVABLE = ("plan", "linear")


@dataclass(frozen=True)
class Choice:
    scheme: str
    group: int
    by: str  # "lm_head", "override", "float role", "plan", "linear" or "embedding"

    @property
    def pair(self) -> tuple[str, int]:
        return self.scheme, self.group

    @property
    def movable(self) -> bool:
        """Does quantize.target_bpw choose this linear's scheme?"""
        return self.by in MOVABLE


def override_matches(o, name: str, role: Optional[str]) -> bool:
    """Does quantize.overrides entry `o` take the linear `name` of `role`?"""
    if o.pattern is not None:
        return fnmatch.fnmatch(name, o.pattern)
    return role is not None and (v(o.role) == role or v(o.role) in archs.FUSED_ROLES.get(role, ()))


def linear(q, name: str, role: Optional[str], head: bool = False, plan: Optional[Mapping] = None) -> Choice:
    """The (scheme, group) of linear `name` (`head`: it is the output projection; `plan`: the allocator's, name ->
    {"scheme", "group_size"})."""
    if head and q.lm_head is not None:
        return Choice(v(q.lm_head), q.lm_head_group_size, "lm_head")
    o = next((o for o in q.overrides if override_matches(o, name, role)), None)
    if o is not None:
        return Choice(v(o.scheme), o.group_size, "override")
    if role in archs.FLOAT_ROLES:
        return Choice("none", 0, "float role")
    if plan and name in plan:
        return Choice(plan[name]["scheme"], plan[name]["group_size"], "plan")
    return Choice(v(q.linear), q.linear_group_size, "linear")


def head(q) -> Choice:
    """The output projection's, named `lm_head` as the geometry names it."""
    return linear(q, "lm_head", "lm_head", head=True)


def embedding(q) -> Choice:
    return Choice(v(q.embedding), q.embedding_group_size, "embedding")


def retied(q, tied_in_model: bool) -> bool:
    """Is a tied lm_head re-tied to the quantized embedding (both take one scheme and group)?"""
    return tied_in_model and q.tie_word_embeddings and embedding(q).scheme != "none" and \
        head(q).pair == embedding(q).pair


def knobs(q) -> list[tuple[str, str, Choice]]:
    """(scheme key, group key, choice) of every part the quantize config names: what preflight checks."""
    parts = [("quantize.linear", "quantize.linear_group_size", Choice(v(q.linear), q.linear_group_size, "linear")),
             ("quantize.embedding", "quantize.embedding_group_size", embedding(q))]
    if q.lm_head is not None:
        parts.append(("quantize.lm_head", "quantize.lm_head_group_size", head(q)))
    for i, o in enumerate(q.overrides):
        parts.append((f"quantize.overrides[{i}].scheme", f"quantize.overrides[{i}].group_size",
                      Choice(v(o.scheme), o.group_size, "override")))
    return parts


def in_use(q) -> set[str]:
    """The schemes the config names, none excluded."""
    return {c.scheme for _, _, c in knobs(q)} - {"none"}


def dynamic_activations(q) -> bool:
    """Does any part of the model quantize its activations at run time?"""
    return any(SCHEMES[s].dynamic for s in in_use(q))
