"""DummyOptim / DummyScheduler: the DeepSpeed JSON's `optimizer` and `scheduler` sections built with torch, one process.

Schedules: the lr each optimizer step uses equals DeepSpeed's formula written out here (WarmupLR, WarmupDecayLR,
WarmupCosineLR; "log" and "linear" warmup), within 1e-12. Optimizers: the built Adam/AdamW/SGD, "auto" filled from
the DummyOptim, train bitwise like the torch optimizer written by hand (torch.equal). Through `Accelerator.prepare`
(ZeRO stage 2 on one process): final weights and lrs equal plain PyTorch within 1e-6. Then Accelerate's usage errors.
"""

import io
import math
import warnings

import pytest
import torch

from accel import Accelerator, DeepSpeedPlugin
from accel.config import ConfigError, DeepSpeedConfigWarning, deepspeed_json_layer
from accel.optimizer import AcceleratedOptimizer
from accel.scheduler import AcceleratedScheduler
from accel.utils import DummyOptim, DummyScheduler, set_seed
from accel.utils.deepspeed import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_optimizer, build_scheduler

TOL = 1e-12


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCEL_LAUNCH_CONFIG", raising=False)


def tiny(seed=0):
    set_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def lrs_used(section, steps, lr=0.1, ticks=1, dummy=None, groups=1):
    """The lr of each group at each of `steps` optimizer steps; the scheduler is stepped `ticks` times after each."""
    model = tiny()
    params = list(model.parameters())
    param_groups = [{"params": params[:2]}, {"params": params[2:], "lr": lr / 2}] if groups == 2 else params
    optimizer = torch.optim.SGD(param_groups, lr=lr)
    scheduler = build_scheduler(section, optimizer, dummy, steps_per_update=ticks)
    used = []
    for _ in range(steps):
        used.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        for _ in range(ticks):
            scheduler.step()
    return used, scheduler


def assert_lrs(used, expected):
    for step, (got, want) in enumerate(zip(used, expected)):
        assert got == pytest.approx(want if isinstance(want, list) else [want], abs=TOL, rel=0), f"step {step}"


# ----------------------------------------------------------------------------------------------------------
# schedules: DeepSpeed's formulas, the lr used by optimizer step k is the schedule at iteration k - 1
# ----------------------------------------------------------------------------------------------------------

def test_warmup_lr_log_and_linear():
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5}
    used, scheduler = lrs_used({"type": "WarmupLR", "params": params}, 9)
    log5 = math.log(5)
    # iteration -1 (DeepSpeed's constructor) and 0 give min_lr; then min + delta * log(i + 1) / log(W); then max
    assert_lrs(used, [0.01, 0.01, 0.01 + 0.09 * math.log(2) / log5, 0.01 + 0.09 * math.log(3) / log5,
                      0.01 + 0.09 * math.log(4) / log5, 0.1, 0.1, 0.1, 0.1])
    assert used[2][0] == pytest.approx(0.0487609, abs=1e-7)  # by hand: 0.01 + 0.09 * 0.430677
    assert type(scheduler).__name__ == "WarmupLR" and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)

    used, _ = lrs_used({"type": "warmuplr", "params": {**params, "warmup_type": "linear"}}, 8)
    assert_lrs(used, [0.01, 0.01, 0.028, 0.046, 0.064, 0.082, 0.1, 0.1])  # min + delta * i / W


def test_warmup_lr_floors_warmup_at_two_steps_and_takes_one_value_per_group():
    used, _ = lrs_used({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.0,
                                                        "warmup_num_steps": 1, "warmup_type": "linear"}}, 4)
    assert_lrs(used, [0.0, 0.0, 0.5, 1.0])  # W = max(2, 1): 0/2, 1/2, then 1
    used, _ = lrs_used({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0], "warmup_max_lr": [0.2, 0.4],
                                                        "warmup_num_steps": 2, "warmup_type": "linear"}}, 4, groups=2)
    assert_lrs(used, [[0.0, 0.0], [0.0, 0.0], [0.1, 0.2], [0.2, 0.4]])


def test_warmup_decay_lr():
    section = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                                                   "total_num_steps": 10, "warmup_type": "linear"}}
    used, _ = lrs_used(section, 13)
    # warmup 0.1 * i / 4 for i < 4; then 0.1 * (10 - i) / (10 - 4), never below 0
    assert_lrs(used, [0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1 * 5 / 6, 0.1 * 4 / 6, 0.05, 0.1 * 2 / 6, 0.1 / 6,
                      0.0, 0.0])
    section["params"]["warmup_type"] = "log"
    used, _ = lrs_used(section, 3)
    assert_lrs(used, [0.0, 0.0, 0.1 * math.log(2) / math.log(4)])


def test_warmup_cosine_lr_scales_each_groups_lr():
    section = {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 3,
                                                    "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                                                    "warmup_type": "linear"}}
    used, _ = lrs_used(section, 11, lr=0.2, groups=2)

    def ratio(i):  # DeepSpeed's get_lr_ratio
        if i < 0:
            return 0.0
        if i < 3:
            return 0.1 + (i / 3) * 0.9
        return max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * (i - 3 + 1) / (8 - 3))) / 2)

    assert_lrs(used, [[0.2 * ratio(k - 1), 0.1 * ratio(k - 1)] for k in range(11)])
    assert used[1][0] == pytest.approx(0.02, abs=TOL) and used[2][0] == pytest.approx(0.08, abs=TOL)  # 0.2 x 0.1, 0.4
    assert used[8][0] == pytest.approx(0.2 * 0.01, abs=TOL)  # the floor at iteration total - 1
    assert used[10][0] > used[9][0] > used[8][0]  # past total_num_steps DeepSpeed's cosine (no clamp) rises again


def test_several_scheduler_steps_per_optimizer_step_follow_the_optimizer_steps():
    """AcceleratedScheduler steps a scheduler num_processes times per optimizer step; the schedule counts those."""
    section = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 3,
                                                   "total_num_steps": 6, "warmup_type": "linear"}}
    once, _ = lrs_used(section, 8)
    twice, scheduler = lrs_used(section, 8, ticks=2)
    assert_lrs(twice, once)
    assert scheduler.last_batch_iteration == 7


def test_scheduler_state_dict_pickles_and_resumes():
    section = {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 4}}
    _, scheduler = lrs_used(section, 7, ticks=2)
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    optimizer = torch.optim.SGD(tiny().parameters(), lr=0.1)
    fresh = build_scheduler(section, optimizer, steps_per_update=2)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    assert fresh.last_epoch == scheduler.last_epoch
    fresh.step()
    fresh.step()
    scheduler.step()
    scheduler.step()
    assert fresh.get_last_lr() == pytest.approx(scheduler.get_last_lr(), abs=TOL)


def test_scheduler_auto_values_come_from_the_dummy_as_accelerate_fills_them():
    model = tiny()
    dummy_optim = DummyOptim(model.parameters(), lr=0.3)
    dummy = DummyScheduler(dummy_optim, total_num_steps=21, warmup_num_steps=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # the JSON's lr: warmup_max_lr still takes 0.3
    section = {"type": "WarmupDecayLR", "params": dict.fromkeys(
        ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto")}
    scheduler = build_scheduler(section, optimizer, dummy, num_processes=2)
    assert (scheduler.min_lrs, scheduler.max_lrs) == ([0.0], [0.3])
    assert (scheduler.warmup_num_steps, scheduler.total_num_steps) == (2, 11)  # max(2, max(1, 0)); ceil(21 / 2)
    assert build_scheduler(section, optimizer, dummy, num_processes=2, split_batches=True).total_num_steps == 21
    real = DummyScheduler(torch.optim.SGD(model.parameters(), lr=0.07), total_num_steps=5)
    assert build_scheduler(section, optimizer, real).max_lrs == [0.07]  # a torch optimizer: defaults["lr"]


# ----------------------------------------------------------------------------------------------------------
# optimizers
# ----------------------------------------------------------------------------------------------------------

def train(optimizer_of, steps=4):
    model = tiny()
    optimizer = optimizer_of(model.parameters())
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("section,dummy_kwargs,expected_cls,expected", [
    ({"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
     {"lr": 0.02, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}, torch.optim.AdamW,
     {"lr": 0.02, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}),
    ({"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.99]}}, {"lr": 0.5}, torch.optim.AdamW,
     {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.0}),  # adam_w_mode defaults to true; FusedAdam's decay 0
    ({"type": "adam", "params": {"lr": "auto", "weight_decay": 0.05, "adam_w_mode": False}}, {"lr": 0.03},
     torch.optim.Adam, {"lr": 0.03, "weight_decay": 0.05}),
    ({"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, {}, torch.optim.AdamW,
     {"lr": 0.01, "weight_decay": 0.01}),  # torch's own AdamW and its default decay
    ({"type": "sgd", "params": {"lr": "auto", "momentum": 0.9, "nesterov": True, "weight_decay": "auto"}},
     {"lr": 0.05, "weight_decay": 1e-3}, torch.optim.SGD,
     {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
])
def test_optimizer_from_the_json_trains_like_the_torch_optimizer(section, dummy_kwargs, expected_cls, expected):
    built, weights = train(lambda params: build_optimizer(section, params, DummyOptim(params, **dummy_kwargs)))
    assert type(built) is expected_cls
    by_hand, reference = train(lambda params: expected_cls(params, **expected))
    assert {k: built.defaults[k] for k in expected} == {k: by_hand.defaults[k] for k in expected}
    for got, want in zip(weights, reference):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------------------
# through Accelerator.prepare
# ----------------------------------------------------------------------------------------------------------

DS_CONFIG = {
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.99]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                      "warmup_type": "linear"}},
}


def plugin(config=DS_CONFIG):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)  # optimizer/scheduler are used: not named
        return DeepSpeedPlugin(hf_ds_config=config)


def test_prepare_builds_the_json_objects_and_trains_like_plain_pytorch():
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    y = x.sum(dim=1, keepdim=True)
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, betas=(0.9, 0.99))

    def schedule(k):  # the lr of optimizer step k + 1: linear warmup over 3 steps, decay to 0 at step 8
        return 0.05 * (k / 3 if k < 3 else max(0.0, (8 - k) / 5))

    reference = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 0.0 if t == 0 else schedule(t - 1) / 0.05)
    ref_lrs = []
    for start in range(0, 32, 4):
        torch.nn.functional.mse_loss(model(x[start:start + 4]), y[start:start + 4]).backward()
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        ref_lrs.append(reference.get_last_lr()[0])

    accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin())
    net = tiny()
    dummy = DummyOptim(net.parameters(), lr=0.05, weight_decay=0.01)
    net, opt, sched = accelerator.prepare(net, dummy, DummyScheduler(dummy, total_num_steps=8, warmup_num_steps=3))
    assert isinstance(opt, AcceleratedOptimizer) and type(opt.optimizer) is torch.optim.AdamW
    assert isinstance(sched, AcceleratedScheduler) and type(sched.scheduler).__name__ == "WarmupDecayLR"
    lrs = []
    for start in range(0, 32, 4):
        accelerator.backward(torch.nn.functional.mse_loss(net(x[start:start + 4]), y[start:start + 4]))
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == pytest.approx(ref_lrs, abs=1e-6)
    weights = accelerator.get_state_dict(net)
    for key, value in model.state_dict().items():
        assert torch.allclose(weights[key], value, atol=1e-6, rtol=0), key


def test_built_scheduler_round_trips_through_save_state(tmp_path):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto",
                                                                 "warmup_num_steps": "auto"}}}

    def make():
        accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin(config))
        model = tiny()
        dummy = DummyOptim(model.parameters(), lr=0.1)
        return accelerator, *accelerator.prepare(model, dummy, DummyScheduler(dummy, total_num_steps=20,
                                                                              warmup_num_steps=4))

    accelerator, model, optimizer, scheduler = make()
    for _ in range(5):
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, _, optimizer2, scheduler2 = make()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert scheduler2.get_last_lr() == scheduler.get_last_lr() == [optimizer2.param_groups[0]["lr"]]
    scheduler.step()
    scheduler2.step()
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def test_lr_scheduler_callable_builds_on_the_real_optimizer_without_a_scheduler_section():
    config = {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin(config))
    model = tiny()
    seen = []

    def factory(optimizer):
        seen.append(optimizer)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    dummy = DummyOptim(model.parameters(), lr=0.4)
    model, opt, sched = accelerator.prepare(model, dummy, DummyScheduler(dummy, lr_scheduler_callable=factory))
    assert type(seen[0]) is torch.optim.SGD and opt.optimizer is seen[0]
    assert isinstance(sched, AcceleratedScheduler) and sched.get_last_lr() == [0.4]


def test_dummies_are_exported_under_accelerates_names():
    import accel.utils
    import accel.utils.deepspeed as module

    assert accel.utils.DummyOptim is module.DummyOptim and accel.utils.DummyScheduler is module.DummyScheduler
    assert {"DummyOptim", "DummyScheduler"} <= set(accel.utils.__all__)
    dummy = DummyScheduler("opt", total_num_steps=3, foo=1)
    assert (dummy.optimizer, dummy.total_num_steps, dummy.warmup_num_steps, dummy.lr_scheduler_callable,
            dummy.kwargs) == ("opt", 3, 0, None, {"foo": 1})
    assert vars(DummyOptim("p", betas=(0.1, 0.2))) == {"params": "p", "lr": 0.001, "weight_decay": 0,
                                                        "kwargs": {"betas": (0.1, 0.2)}}


# ----------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------

def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("section,match", [
    ({"type": "Lamb"}, "key 'optimizer.type': bad value 'Lamb'; allowed: Adam, AdamW, SGD"),
    ({"params": {}}, "key 'optimizer.type': bad value None; allowed: Adam, AdamW, SGD"),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}},
     "key 'optimizer.params.max_grad_norm': not a parameter of AdamW in accel; allowed: lr, betas"),
    ({"type": "AdamW", "params": {"betas": "auto"}},
     ("key 'optimizer.params.betas': \"auto\" but DummyOptim gives no betas; allowed: a value in the JSON, or "
     "DummyOptim(..., betas=...)")),
    ({"type": "AdamW", "params": {"lr": "fast"}}, "key 'optimizer.params.lr': bad value 'fast'; allowed: a number"),
    ({"type": "AdamW", "params": {"betas": [0.9]}}, "key 'optimizer.params.betas': bad value [0.9]; allowed: two"),
    ({"type": "Adam", "params": {"bias_correction": False}}, "key 'optimizer.params.bias_correction': false is not"),
])
def test_bad_optimizer_sections(section, match):
    with pytest.raises(ConfigError) as exc_info:
        build_optimizer(section, tiny().parameters(), DummyOptim(None), source="ds.json")
    assert one_line(exc_info).startswith("ds.json: ") and match in str(exc_info.value)


@pytest.mark.parametrize("section,match", [
    ({"type": "OneCycle"}, ("key 'scheduler.type': bad value 'OneCycle'; allowed: WarmupLR, WarmupDecayLR, "
                           "WarmupCosineLR")),
    ({"type": "WarmupDecayLR", "params": {}}, "key 'scheduler.params.total_num_steps' is missing"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
     ("key 'scheduler.params.total_num_steps': \"auto\" but nothing fills it; allowed: a value in the JSON, or "
     "DummyScheduler(..., total_num_steps=...)")),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
     "key 'scheduler.params.warmup_type': bad value 'cosine'; allowed: log, linear"),
    ({"type": "WarmupCosineLR", "params": {"warmup_max_lr": 0.1, "total_num_steps": 9}},
     "key 'scheduler.params.warmup_max_lr': not a parameter of WarmupCosineLR in accel"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 10}},
     "key 'scheduler.params.total_num_steps': 10 is not above the 10 warmup steps"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}},
     "key 'scheduler.params.warmup_max_lr': 2 values for 1 parameter groups"),
])
def test_bad_scheduler_sections(section, match):
    optimizer = torch.optim.SGD(tiny().parameters(), lr=0.1)
    with pytest.raises(ConfigError) as exc_info:
        build_scheduler(section, optimizer, DummyScheduler(optimizer), source="ds.json")
    assert one_line(exc_info).startswith("ds.json: ") and match in str(exc_info.value)


def test_accelerates_usage_rules():
    model = tiny()
    # no DeepSpeed config at all: say what to do
    with pytest.raises(ValueError) as exc_info:
        Accelerator(cpu=True).prepare(model, DummyOptim(model.parameters()))
    assert "DeepSpeedPlugin(hf_ds_config=...)" in one_line(exc_info)
    with pytest.raises(ValueError, match="DummyScheduler needs a DeepSpeed config"):
        Accelerator(cpu=True).prepare(DummyScheduler(torch.optim.SGD(model.parameters(), lr=0.1)))

    no_sections = Accelerator(cpu=True, deepspeed_plugin=plugin({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError, match="You cannot create a `DummyOptim` without specifying an optimizer in the "
                                         "config file"):
        no_sections.prepare(model, DummyOptim(model.parameters()))
    with pytest.raises(ValueError, match="Either specify a scheduler in the config file or pass in the "
                                         "`lr_scheduler_callable`"):
        no_sections.prepare(DummyScheduler(torch.optim.SGD(model.parameters(), lr=0.1)))

    accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as exc_info:
        accelerator.prepare(model, optimizer)
    assert one_line(exc_info).startswith("You cannot specify an optimizer in the config file and in the code at the "
                                         "same time: DeepSpeedPlugin(hf_ds_config=...) has an 'optimizer' section")
    with pytest.raises(ValueError, match="You cannot specify a scheduler in the config file and in the code"):
        accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    with pytest.raises(ValueError, match="its DummyOptim was not prepared"):
        accelerator.prepare(DummyScheduler(DummyOptim(model.parameters()), total_num_steps=4))
    only_optimizer = {k: v for k, v in DS_CONFIG.items() if k != "scheduler"}
    with pytest.raises(ValueError, match="a torch scheduler was passed with a DummyOptim"):
        Accelerator(cpu=True, deepspeed_plugin=plugin(only_optimizer)).prepare(
            DummyOptim(model.parameters()), torch.optim.lr_scheduler.StepLR(torch.optim.SGD(tiny().parameters()), 1))
    # a real optimizer with only a scheduler section in the JSON: Accelerate allows it
    only_scheduler = {k: v for k, v in DS_CONFIG.items() if k != "optimizer"}
    opt, sched = Accelerator(cpu=True, deepspeed_plugin=plugin(only_scheduler)).prepare(
        optimizer, DummyScheduler(optimizer, total_num_steps=8, warmup_num_steps=2))
    assert sched.scheduler.max_lrs == [0.1] and opt.optimizer is optimizer


def test_json_sections_are_kept_only_where_they_reach_prepare():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        deepspeed_json_layer(DS_CONFIG, "ds.json", builds_optimizer=True)
    with pytest.raises(ConfigError, match="ds.json: key 'optimizer': expected a JSON object"):
        deepspeed_json_layer({"optimizer": "AdamW"}, "ds.json", builds_optimizer=True)
    with pytest.warns(DeepSpeedConfigWarning, match="ignored: optimizer, scheduler; .*only from a JSON that "
                                                    "reaches prepare"):
        deepspeed_json_layer(DS_CONFIG, "ds.json")  # a JSON that is not carried to prepare()


def test_schedulers_are_usable_directly():
    optimizer = torch.optim.SGD(tiny().parameters(), lr=0.1)
    assert WarmupLR(optimizer, warmup_max_lr=0.2, warmup_num_steps=4).get_last_lr() == [0.0]
    assert WarmupDecayLR(optimizer, total_num_steps=10).total_num_steps == 10
    assert WarmupCosineLR(optimizer, total_num_steps=2000).get_last_lr() == [0.0]
    with pytest.raises(ValueError, match="argument 'warmup_type': bad value 'cos'; allowed: log, linear"):
        WarmupLR(optimizer, warmup_type="cos")
