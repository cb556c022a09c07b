"""Cutting models into pipeline stages (no processes): where the cuts go, the errors, and that running the
stage models one after another in one process gives exactly the whole model's output."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from accel.backends.pipeline_split import (
    SplitError,
    StagePlan,
    _partition,
    balanced_split_points,
    check_split_points,
    run_stage,
    stage_model,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "multiproc" / "scripts"))
import pp_train  # noqa: E402  (the toy models the multi-process tests train)

sys.path.pop(0)


def run_all(model: nn.Module, points: list[str], *args):
    """Run every stage model in turn, passing each one's output to the next, as the pipeline does."""
    plan = StagePlan(model, points)
    received = None
    for stage in range(plan.num_stages):
        shell, run = stage_model(model, plan, {stage})
        received = run_stage(shell, run, stage, received, args, {})
    return received


def test_partition_minimises_the_largest_stage():
    assert _partition([1, 1, 1, 1], 2) == [0, 2]
    assert _partition([10, 1, 1, 1, 1], 2) == [0, 1]
    assert _partition([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5]


def test_sequential_splits_between_layers_with_parameters():
    model = pp_train.make_model("seq")  # Linear/Tanh x4, Linear: Tanh owns nothing, so no stage starts there
    assert balanced_split_points(model, 2) == ["4"]  # parameters 224 + 1056 | 1056 + 528 + 17
    assert balanced_split_points(model, 4) == ["2", "4", "6"]


def test_gpt_splits_by_blocks():
    model = pp_train.make_model("gpt")
    assert balanced_split_points(model, 2) == ["layers.2"]
    assert balanced_split_points(model, 4) == ["layers.1", "layers.2", "layers.3"]


@pytest.mark.parametrize("kind,points", [("seq", ["2"]), ("seq", ["2", "4", "6"]), ("gpt", ["layers.2"]),
                                         ("gpt", ["layers.1", "layers.2", "layers.3"])])
def test_stages_in_turn_equal_the_whole_model(kind, points):
    model = pp_train.make_model(kind)
    x, _ = pp_train.make_data(kind, n=4)
    with torch.no_grad():
        assert torch.equal(run_all(model, points, x), model(x))


def test_stage_models_keep_original_names_and_objects():
    model = pp_train.make_model("gpt")
    plan = StagePlan(model, ["layers.2"])
    first, _ = stage_model(model, plan, {0})
    last, _ = stage_model(model, plan, {1})
    originals = dict(model.named_parameters(remove_duplicate=False))
    for shell in (first, last):
        for name, param in shell.named_parameters(remove_duplicate=False):
            assert param is originals[name]
    assert "layers.1.up_proj.weight" in dict(first.named_parameters())
    assert "layers.2.up_proj.weight" not in dict(first.named_parameters())
    assert {"norm.weight", "lm_head.weight"} <= set(dict(last.named_parameters(remove_duplicate=False)))
    # the head is tied to the embedding: the weight is used by both stages
    assert plan.stages_of_param(model)[id(model.lm_head.weight)] == {0, 1}


def test_split_point_errors_name_the_module():
    model = pp_train.make_model("gpt")
    with pytest.raises(SplitError, match="'layers.9' is not a module of TinyGPT; did you mean 'layers.3'"):
        check_split_points(model, ["layers.9"], 2)
    with pytest.raises(SplitError, match="2 names for 2 stages; allowed: exactly 1"):
        check_split_points(model, ["layers.1", "layers.2"], 2)
    with pytest.raises(SplitError, match="'layers.1' comes before 'layers.3'"):
        check_split_points(model, ["layers.3", "layers.1"], 3)
    with pytest.raises(SplitError, match="'layers.1.norm' is inside 'layers.1'"):
        check_split_points(model, ["layers.1", "layers.1.norm"], 3)
    with pytest.raises(SplitError, match="split point 'layers.1.drop' owns no parameters"):
        StagePlan(model, ["layers.1.drop"])
    with pytest.raises(SplitError, match="'layers' has 4 blocks, too few for 8 stages"):
        balanced_split_points(model, 8)


def test_models_that_cannot_be_split():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(SplitError, match="cannot split Flat automatically.*pp_split_points"):
        balanced_split_points(Flat(), 2)
    flat = Flat()  # named split points work for any model
    with torch.no_grad():
        assert torch.equal(run_all(flat, ["b"], torch.ones(1, 2)), flat(torch.ones(1, 2)))

    class OwnWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(2))
            self.inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    with pytest.raises(SplitError, match="cannot split inside the root module \\(OwnWeight\\): it owns parameters"):
        StagePlan(OwnWeight(), ["inner.1"])


def test_a_split_against_the_forward_order_is_an_error():
    class Backwards(nn.Module):  # defines a then b, but calls b first
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(self.b(x))

    with pytest.raises(SplitError, match="must follow the order in which forward calls the modules"):
        run_all(Backwards(), ["b"], torch.ones(1, 2))


def test_reading_another_stages_weight_is_a_clear_error():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.body = nn.Embedding(4, 2), nn.Linear(2, 2)

        def forward(self, idx):
            return self.body(self.embed(idx)) @ self.embed.weight.T  # the head reads the embedding's weight

    with pytest.raises(AttributeError, match="reads 'embed.weight', but module 'embed' lives on stage 0"):
        run_all(Reads(), ["body"], torch.tensor([[1, 2]]))


def test_a_stage_runs_the_forward_a_part_wrapped_around_the_model():
    """A part's install wraps the model's forward (e.g. adding the sequence slice's position ids): each stage runs
    the model's forward through that wrapper, with the inputs it was given, on every stage."""
    model = pp_train.make_model("gpt")
    plan = StagePlan(model, balanced_split_points(model, 2))
    x = torch.randint(0, pp_train.VOCAB, (2, pp_train.SEQ))
    seen = []
    received = None
    for stage in range(plan.num_stages):
        shell, run = stage_model(model, plan, {stage})
        model_forward = shell.forward

        def wrapper(*args, _forward=model_forward, _stage=stage, **kwargs):
            seen.append(_stage)
            return _forward(*args, **kwargs)

        received = run_stage(shell, run, stage, received, (x,), {}, wrapper)
    assert seen == [0, 1]
    torch.testing.assert_close(received, model(x), atol=0, rtol=0)
