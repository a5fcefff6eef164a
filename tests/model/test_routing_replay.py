"""Wrap's self-check on a mixture of experts whose router ties (pipeline/model/layers/routing_replay.py): the wrapped
module runs on HF's routing, so an order of summation cannot pick another expert and fail the check by chance."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.cache_modes import wrap
from pipeline.model.geometry import from_config
from pipeline.model.layers import routing_replay
from pipeline.model.layers.exportable import make_exportable
from pipeline.stages.wrap import compare, hf_reference
from tests.model.test_archs import tiny_model


def tied_moe(model_type: str):
    """A tiny MoE whose experts 2 and 3 score the same for every token: their router rows are equal."""
    model = tiny_model(model_type)
    with torch.no_grad():
        for router in routing_replay.routers(model):
            router.weight[3] = router.weight[2]
    return model


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_near_tie_in_the_router_does_not_decide_the_check(model_type):
    model = tied_moe(model_type)
    g = from_config(model.config.get_text_config())
    with torch.no_grad():
        reference = hf_reference(model, 64, 8, g.sliding_window, g.vocab_size)
        make_exportable(model)
        module = wrap(model, "custom", 64, "last", 8)
        # the wrapped run's sums round otherwise: here, the tie broken the other way by a last-bit nudge
        for router in routing_replay.routers(model):
            router.weight[3] += router.weight[2].abs() * 1e-6
        replayed = compare(module, reference, 8)
        module.reset()
        unreplayed = compare(module, reference._replace(routing=[[] for _ in reference.routing]), 8)
    tol = 1e-4 * max(replayed["logit_scale"], 10)
    moe_layers = len(routing_replay.routers(model))
    assert replayed["routed_rows"] == moe_layers * replayed["tokens"]
    assert replayed["rerouted_rows"] > 0  # its own router chose otherwise for some rows
    assert replayed["max_abs_err"] < tol, replayed
    assert unreplayed["max_abs_err"] > 10 * tol, unreplayed  # on its own routing the check would have failed


def test_a_router_that_runs_more_rows_than_hf_s_forward_is_an_error():
    model = tiny_model("qwen3_moe")
    with torch.no_grad(), routing_replay.recorded(model) as record:
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    with torch.no_grad(), routing_replay.replayed(model, record) as counts:
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
        assert counts == {"routed_rows": 3 * len(record), "rerouted_rows": 0}
        with pytest.raises(RuntimeError, match="routing replay: router 0 ran 4 rows, HF's forward 3"):
            model(input_ids=torch.tensor([[5]]), use_cache=False)
