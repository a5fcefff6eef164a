"""Logits mode `tail`: a forward returns the logits of its last min(T, K) rows, T dynamic in [1, chunk].

A decode step computes one row (as `last`), a verify step of K rows every row (as `full`), and ExecuTorch's
TextLLMRunner, which passes (tokens, positions) and reads the last row, drives it unchanged.

torch.export cannot slice `h[:, -K:]` over a dynamic T (it specializes on T < K), so the rows are an index vector of
min(T, K) entries (a backed size, which XNNPACK accepts), and the head runs on them as 2-d rows: a linear over
[1, min(T, K), D] makes the exporter ask whether min(T, K) is 1, which it cannot answer for every T.
"""
from __future__ import annotations

import torch
from torch import nn


def tail_indices(T, k: int) -> torch.Tensor:
    """The step's last min(T, k) row indices (T a Python int, or a dynamic size while exporting)."""
    n = torch.sym_min(T, int(k))
    return torch.arange(n) + (T - n)


class RowsHead(nn.Module):
    """An lm_head applied to the kept rows as 2-d rows ([1, R, D] -> [R, D] -> [1, R, V]): the same products."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x[0])[None] if x.dim() == 3 and x.shape[0] == 1 else self.head(x)


def head_on_rows(model: nn.Module) -> bool:
    """Before exporting a `tail` program: run the model's lm_head, a linear, on 2-d rows (an op of ours, the tied
    head, takes any leading dims, and a reshape after it would be a delegate call of its own). Returns whether it
    was done."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return False
    model.set_output_embeddings(RowsHead(head))
    return True
