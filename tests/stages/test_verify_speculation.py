"""verify's eager references: greedy with a guess and teacher forcing in chunks give what one token per call gives,
in every cache mode, past a sliding window, in a fraction of the calls."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.cache_modes import wrap
from pipeline.stages.verify import greedy, teacher_forced
from tests.model.test_offgraph import tiny_gemma3

CHUNK, N = 8, 24  # 20 prompt tokens + 24 new: past the window of 16, several rings' worth of rewinds


class Stepwise:
    """The same module seen as a built program: no logits_mode, so every helper feeds it one token per call."""

    def __init__(self, module):
        self.module = module

    def __call__(self, tokens, positions):
        return self.module(tokens, positions)


class Counted(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    @property
    def logits_mode(self):
        return self.module.logits_mode

    @logits_mode.setter
    def logits_mode(self, mode):
        self.module.logits_mode = mode

    def forward(self, tokens, positions):
        self.calls += 1
        return self.module(tokens, positions)


def guesses(plain: list[int]) -> dict[str, list[int]]:
    wrong = list(plain)
    for i in (3, 11, 12, 19):
        wrong[i] = (wrong[i] + 1) % 128
    return {"exact": plain, "wrong in places": wrong, "garbage": [(7 * i) % 128 for i in range(N)], "none": []}


@pytest.mark.parametrize("mode", ["static", "custom", "offgraph"])
def test_greedy_with_a_guess_equals_one_step_per_call(mode):
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    module = Counted(wrap(tiny_gemma3(), mode, 64, "last", CHUNK))
    plain, plain_logits = greedy(Stepwise(module), ids, N, CHUNK, eos=set())
    stepwise_calls = module.calls
    for name, guess in guesses(plain).items():
        module.calls = 0
        got, got_logits = greedy(module, ids, N, CHUNK, eos=set(), guess=guess)
        assert got == plain, name
        assert max((a - b).abs().max().item() for a, b in zip(got_logits, plain_logits)) < 1e-4, name
        if name == "exact":  # 3 prefill calls, then 23 tokens in chunks of 8
            assert module.calls <= 3 + 3 < stepwise_calls, (module.calls, stepwise_calls)
    assert module.logits_mode == "last"  # restored after every call


def test_greedy_stops_at_eos_inside_a_guessed_run():
    ids = list(range(10, 30))
    module = wrap(tiny_gemma3(), "custom", 64, "last", CHUNK)
    plain, _ = greedy(Stepwise(module), ids, N, CHUNK, eos=set())
    stop = plain[9]
    want, _ = greedy(Stepwise(module), ids, N, CHUNK, eos={stop})
    got, steps = greedy(module, ids, N, CHUNK, eos={stop}, guess=plain)
    assert got == want and got[-1] == stop and len(steps) == len(got)


@pytest.mark.parametrize("mode", ["static", "custom", "offgraph"])
def test_teacher_forcing_in_chunks_equals_one_step_per_call(mode):
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    targets = torch.randint(0, 128, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    module = wrap(tiny_gemma3(), mode, 64, "last", CHUNK)
    chunked = teacher_forced(module, ids, targets, CHUNK)
    stepwise = teacher_forced(Stepwise(module), ids, targets, CHUNK)
    assert len(chunked) == len(stepwise) == N
    assert max((a - b).abs().max().item() for a, b in zip(chunked, stepwise)) < 1e-4


@pytest.mark.parametrize("mode", ["static", "custom", "offgraph"])
def test_teacher_forcing_after_a_greedy_run_starts_after_the_prompt(mode):
    """What verify does on models without rings: the module holds the prompt from its greedy run, so teacher
    forcing another token stream feeds only that stream (the greedy run's tokens past the prompt are overwritten)."""
    from tests.model.test_offgraph import tiny_llama
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    targets = torch.randint(0, 128, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    module = wrap(tiny_llama(), mode, 64, "last", CHUNK)
    fresh = teacher_forced(module, ids, targets, CHUNK)
    for runner in (module, Stepwise(module)):
        _, steps = greedy(runner, ids, N, CHUNK, eos=set())
        again = teacher_forced(runner, ids, targets, CHUNK, prefilled=steps[0])
        assert max((a - b).abs().max().item() for a, b in zip(again, fresh)) < 1e-4


@pytest.mark.parametrize("mode", ["custom", "offgraph"])
def test_a_ring_steps_back_to_the_prompt_while_n_is_at_most_the_chunk(mode):
    """What verify does on models with rings of window + chunk - 1 slots: after the prompt and n - 1 more tokens
    (n <= chunk), the ring still holds the window behind the prompt's end, so teacher forcing from there gives the
    bits of a fresh run. 20 prompt tokens + 8 wrap the rings of 23 slots (window 16, chunk 8)."""
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    targets = torch.randint(0, 128, (CHUNK,), generator=torch.Generator().manual_seed(9)).tolist()
    module = wrap(tiny_gemma3(), mode, 64, "last", CHUNK)
    for runner in (module, Stepwise(module)):
        fresh = teacher_forced(runner, ids, targets, CHUNK)
        _, steps = greedy(runner, ids, CHUNK, CHUNK, eos=set())
        again = teacher_forced(runner, ids, targets, CHUNK, prefilled=steps[0])
        assert len(again) == CHUNK and all(torch.equal(a, b) for a, b in zip(again, fresh))
    if mode == "offgraph":  # further on, the runtime-owned ring refuses the step back (verify starts over there)
        greedy(Stepwise(module), ids, 2 * CHUNK, CHUNK, eos=set())
        with pytest.raises(Exception, match="rewind|ring|window"):
            teacher_forced(module, ids, targets, CHUNK, prefilled=steps[0])
