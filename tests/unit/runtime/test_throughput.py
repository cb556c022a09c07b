"""The throughput monitor (accel/runtime/throughput.py) on one process: what it counts from batches, its arithmetic
(tokens/s, step time, MFU) against hand-computed figures, the GPU peak table, the CPU peak cache, the config key and
arguments, nothing installed when off, the progress bar's text, and its keys in TensorBoard and `accel plot`."""

import io
import itertools
import json
import types

import pytest
import torch

from accel import Accelerator, ThroughputMonitorKwargs
from accel.config import ConfigError
from accel.planning import peak_flops
from accel.runtime import progress, throughput
from accel.runtime.throughput import MFU, PEAK_MEMORY, SAMPLES, STEP_TIME, TFLOPS, TOKENS, TOKENS_PER_DEVICE

VOCAB, HIDDEN, LAYERS, HEADS = 32, 16, 2, 2
BATCH, SEQ = 4, 8


class TinyLM(torch.nn.Module):
    """An untied embedding, LAYERS blocks of one HIDDEN x HIDDEN linear, a head; a transformers-like `config`."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())


# By hand: the planner counts the matmul parameters (all but the untied embedding, a lookup): blocks 2 x (16*16 + 16),
# head 32*16 + 32 -> 1088; FLOPs per token = 6 x 1088 + attention 12 x layers x hidden x seq.
MATMUL_PARAMS = LAYERS * (HIDDEN * HIDDEN + HIDDEN) + VOCAB * HIDDEN + VOCAB
FLOPS_PER_TOKEN = 6 * MATMUL_PARAMS + 12 * LAYERS * HIDDEN * SEQ


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the CPU peak cache
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCEL_LAUNCH_CONFIG", raising=False)
    yield
    progress.show_status(False)
    progress.set_status("")


def loader(batches=12):
    torch.manual_seed(0)
    data = [torch.randint(0, VOCAB, (SEQ,)) for _ in range(BATCH * batches)]
    return torch.utils.data.DataLoader([{"input_ids": ids} for ids in data], batch_size=BATCH)


class Clock:
    """A clock the test moves: `tick` seconds per optimizer step."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def train(accelerator, steps=7, tick=0.5, clock=None):
    model = TinyLM()
    model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), loader())
    if clock is not None:
        accelerator.throughput.clock = clock
    model.train()
    for batch in itertools.islice(data, steps):  # no batch fetched past the last step
        accelerator.backward(model(batch["input_ids"]))
        if clock is not None:
            clock.now += tick
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, data


def test_batch_counts_from_shapes():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert throughput.batch_counts({"input_ids": ids, "attention_mask": torch.ones(4, 16)}) == (4, 64, 16)
    assert throughput.batch_counts({"labels": torch.zeros(4), "ids": ids}) == (4, 64, 16)  # first 2-D int tensor
    assert throughput.batch_counts((ids[:2, :8], torch.zeros(2, dtype=torch.long))) == (2, 16, 8)
    assert throughput.batch_counts((torch.randn(5, 3), torch.zeros(5, dtype=torch.long))) == (5, 0, 0)  # no tokens
    assert throughput.batch_counts(torch.randn(6, 3)) == (6, 0, 0)
    assert throughput.batch_counts("text") == (0, 0, 0)


def test_window_figures_and_mfu_against_a_hand_computation():
    peak = 2e9
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ThroughputMonitorKwargs(log_every=3, peak_flops=peak)])
    clock = Clock()
    train(accelerator, steps=7, tick=0.5, clock=clock)
    monitor = accelerator.throughput
    assert monitor.steps == 7
    # step 1 opens the window; steps 2-4 are the first report, 5-7 the second: 3 steps x 0.5 s, 3 batches
    seconds, tokens = 1.5, 3 * BATCH * SEQ
    metrics = monitor.metrics
    assert metrics[STEP_TIME] == pytest.approx(0.5)
    assert metrics[SAMPLES] == pytest.approx(3 * BATCH / seconds)
    assert metrics[TOKENS] == pytest.approx(tokens / seconds) == metrics[TOKENS_PER_DEVICE]
    assert metrics[TFLOPS] == pytest.approx(FLOPS_PER_TOKEN * tokens / seconds / 1e12)
    assert metrics[MFU] == pytest.approx(100 * FLOPS_PER_TOKEN * tokens / seconds / peak)
    assert metrics[PEAK_MEMORY] > 0.001  # this process's peak resident set, in GB


def test_user_flops_per_token_wins_and_eval_batches_are_not_counted():
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ThroughputMonitorKwargs(log_every=2, flops_per_token=1e6,
                                                                                 peak_flops=1e9)])
    clock = Clock()
    model, optimizer, data = train(accelerator, steps=3, tick=1.0, clock=clock)
    assert accelerator.throughput.metrics[MFU] == pytest.approx(100 * 1e6 * 2 * BATCH * SEQ / 2.0 / 1e9)
    model.eval()
    assert len(list(data)) == 12  # an evaluation pass between steps adds nothing
    model.train()
    batch = next(iter(data))
    clock.now += 1.0
    optimizer.step()
    clock.now += 1.0
    optimizer.step()
    assert accelerator.throughput.steps == 5
    assert accelerator.throughput.metrics[TOKENS] == pytest.approx(BATCH * SEQ / 2.0)  # the one training batch
    assert batch is not None


def test_off_by_default_installs_nothing():
    accelerator = Accelerator(cpu=True)
    assert accelerator.throughput is None
    model, optimizer, data = accelerator.prepare(TinyLM(), torch.optim.SGD(TinyLM().parameters(), lr=0.1), loader())
    assert optimizer._throughput is None
    assert data.batch_transform is accelerator.backend.batch_transform  # no counting wrapper
    assert not hasattr(data.batch_transform, "counted_transform")
    assert Accelerator(cpu=True, throughput_monitor=False,
                       kwargs_handlers=[ThroughputMonitorKwargs()]).throughput is None  # False wins


def test_config_key_turns_it_on_and_bad_values_are_one_line(tmp_path, monkeypatch):
    good = tmp_path / "on.yaml"
    good.write_text("throughput_monitor: true\nthroughput_log_every: 4\n")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(good))
    accelerator = Accelerator(cpu=True)
    assert accelerator.throughput is not None and accelerator.throughput.log_every == 4
    model, optimizer, data = accelerator.prepare(TinyLM(), torch.optim.SGD(TinyLM().parameters(), lr=0.1), loader())
    assert optimizer._throughput is accelerator.throughput
    assert data.batch_transform.counted_transform is accelerator.backend.batch_transform
    assert Accelerator(cpu=True, kwargs_handlers=[ThroughputMonitorKwargs(log_every=9)]).throughput.log_every == 9

    from accel.config.resolve import read_config_file

    for text, key, value, allowed in (("throughput_log_every: 0\n", "throughput_log_every", "0", "an integer >= 1"),
                                      ("throughput_monitor: 'yes'\n", "throughput_monitor", "'yes'", "true or false")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError) as info:
            read_config_file(str(bad))
        message = str(info.value)
        assert "\n" not in message
        assert message == f"{bad}: key '{key}': bad value {value}; allowed: {allowed}"
    with pytest.raises(ValueError, match=r"'log_every': bad value 0; allowed: an integer >= 1"):
        ThroughputMonitorKwargs(log_every=0)
    with pytest.raises(ValueError, match=r"'peak_flops': bad value -1.0; allowed: a finite number > 0"):
        ThroughputMonitorKwargs(peak_flops=-1.0)
    with pytest.raises(TypeError, match=r"throughput_monitor=...\): bad value 'yes'"):
        Accelerator(cpu=True, throughput_monitor="yes")


def test_gpu_peak_table():
    assert peak_flops.gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert peak_flops.gpu_peak("NVIDIA H200", "bf16") == pytest.approx(989.5e12)
    assert peak_flops.gpu_peak("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert peak_flops.gpu_peak("NVIDIA H100 NVL", "tf32") == pytest.approx(417.5e12)
    assert peak_flops.gpu_peak("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert peak_flops.gpu_peak("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert peak_flops.gpu_peak("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5e12)
    assert peak_flops.gpu_peak("NVIDIA A100-SXM4-80GB", "fp8") == pytest.approx(312e12)  # no fp8 math: bf16's
    assert peak_flops.gpu_peak("NVIDIA L40S", "bf16") == pytest.approx(362.05e12)
    assert peak_flops.gpu_peak("NVIDIA A10G", "bf16") == pytest.approx(125e12)
    assert peak_flops.gpu_peak("Some Future GPU", "bf16") is None
    assert peak_flops.precision_of("bf16", cuda=False) == peak_flops.precision_of("fp16", cuda=True) == "bf16"
    assert peak_flops.precision_of("no", cuda=False) == "fp32"


def test_cpu_peak_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak_flops, "measure_cpu_peak", lambda dtype: calls.append(dtype) or 1.5e11)
    path = peak_flops.cache_path()
    assert path == tmp_path / "cache" / "accel" / "peak_flops.json"
    assert peak_flops.cpu_peak("fp32") == (1.5e11, True)
    assert peak_flops.cpu_peak("fp32") == (1.5e11, False)
    assert calls == ["float32"]
    entries = json.loads(path.read_text())
    assert list(entries) == [peak_flops.cpu_key("float32")]
    assert f"threads={torch.get_num_threads()}" in peak_flops.cpu_key("float32")
    peak_flops.cpu_peak("bf16")  # another dtype: its own entry
    assert calls == ["float32", "bfloat16"] and len(json.loads(path.read_text())) == 2
    path.write_text("not json")  # a damaged cache is measured over
    assert peak_flops.cpu_peak("fp32") == (1.5e11, True)


def test_progress_bar_tensorboard_and_plot_show_the_keys(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from accel.cli import plot, plot_style
    from accel.utils import tqdm

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / "runs"),
                              throughput_monitor=True, kwargs_handlers=[ThroughputMonitorKwargs(log_every=2)])
    accelerator.init_trackers("tp")
    train(accelerator, steps=5)  # real clock, CPU peak measured into tmp_path's cache
    metrics = accelerator.throughput.metrics
    assert (tmp_path / "cache" / "accel" / "peak_flops.json").is_file()
    assert metrics[MFU] > 0 and metrics[TOKENS] > 0

    out = io.StringIO()
    bar = tqdm(range(3), file=out, mininterval=0)
    for _ in bar:
        bar.set_postfix(loss=1.0)  # the script's own postfix keeps the monitor's text after it
    bar.close()
    text = str(bar)
    assert "loss=1, " in text and " tok/s, MFU " in text and " s/step" in text
    assert progress.status() == throughput.status_text(metrics)
    accelerator.end_training()

    events = EventAccumulator(str(tmp_path / "runs" / "tp"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {STEP_TIME, SAMPLES, TOKENS, TOKENS_PER_DEVICE, TFLOPS, MFU, PEAK_MEMORY} <= tags
    assert [e.step for e in events.Scalars(MFU)] == [3, 5]
    assert events.Scalars(MFU)[-1].value == pytest.approx(metrics[MFU], rel=1e-5)

    runs = plot.load_runs([str(tmp_path / "runs" / "tp")])
    html = __import__("accel.cli.plot_html", fromlist=["render_html"]).render_html(runs, [MFU, PEAK_MEMORY], 0.6)
    assert "throughput/mfu_percent (%)" in html and "throughput/peak_memory_gb (GB)" in html
    assert plot_style.smoothing_for(PEAK_MEMORY, 0.6) == 0.0  # a running maximum: drawn as it is
    assert plot_style.smoothing_for(TOKENS, 0.6) == 0.6


def test_steps_go_on_after_load_state(tmp_path):
    """save_state keeps the monitor's step count and load_state gives it back: a resumed run logs each step once (its
    windows were counted from 0 again, so steps 4, 7, 10 were logged twice)."""
    def run(resume: bool, steps: int) -> tuple[list, int]:
        accelerator = Accelerator(cpu=True, throughput_monitor=True,
                                  kwargs_handlers=[ThroughputMonitorKwargs(log_every=3, flops_per_token=1.0)])
        logged: list = []
        accelerator.log = lambda values, step=None, log_kwargs=None: logged.append(step)  # type: ignore[method-assign]
        model = TinyLM()
        model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), loader(20))
        if resume:
            accelerator.load_state(str(tmp_path / "ckpt"))
        start = accelerator.throughput.steps
        for batch in itertools.islice(data, steps):
            accelerator.backward(model(batch["input_ids"]))
            optimizer.step()
            optimizer.zero_grad()
        if not resume:
            accelerator.save_state(str(tmp_path / "ckpt"))
        accelerator.end_training()
        return logged, start

    first, _ = run(False, 10)
    second, start = run(True, 9)
    assert first == [4, 7, 10]
    assert start == 10 and second == [14, 17]
    assert not set(first) & set(second)
