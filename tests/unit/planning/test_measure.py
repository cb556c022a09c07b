"""`accel plan --measure` / `--calibrate`: the stop-after-N-steps hook, the calibration file, one real measure."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import yaml

from accel import Accelerator
from accel.cli.main import main
from accel.planning.measure import FILE_ENV, STOP_ENV

TINY = '''import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(2))
    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x
def net():
    return Net()
'''

TRAIN = '''import torch
from accel import Accelerator
from tiny import net
acc = Accelerator()
model = net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = acc.prepare(model, opt)
x = torch.randn(4, 32)
for _ in range(1000):
    acc.backward(model(x.to(acc.device)).pow(2).mean())
    opt.step()
    opt.zero_grad()
raise SystemExit(3)  # never reached: accel stops the job after --steps optimizer steps
'''


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", STOP_ENV, FILE_ENV):
        monkeypatch.delenv(name, raising=False)


def _loop(micro_steps: int, accumulation: int = 1):
    acc = Accelerator(gradient_accumulation_steps=accumulation)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for _ in range(micro_steps):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(2, 8)).sum())
            opt.step()
            opt.zero_grad()
    return opt


def test_stop_hook_counts_real_steps_and_writes_the_record(tmp_path, monkeypatch):
    assert _loop(6)._meter is None  # no env var: the loop runs to its end, no meter
    out = tmp_path / "m"
    monkeypatch.setenv(STOP_ENV, "3")
    monkeypatch.setenv(FILE_ENV, str(out))
    with pytest.raises(SystemExit) as exc:
        _loop(100, accumulation=2)
    assert exc.value.code == 0
    rec = json.loads((tmp_path / "m.rank0.json").read_text())
    assert rec["steps"] == 3 and len(rec["step_times_s"]) == 3 and min(rec["step_times_s"]) > 0
    # Linear(8, 4): 36 float32 params, their grads, AdamW's two moments (+ its scalar step tensors)
    assert 36 * 16 <= rec["peak_memory_bytes"] <= 36 * 16 + 2 * 8 and rec["max_rss_bytes"] > 0


def test_calibrate_writes_positive_figures_and_plan_uses_them(tmp_path, monkeypatch, capsys):
    from accel.planning import measure

    monkeypatch.setattr(measure, "EFFORT", measure.QUICK)  # the same figures, measured for less long
    cal = tmp_path / "cache" / "accel" / "calibration.json"
    assert main(["plan", "--calibrate"]) == 0
    data = json.loads(cal.read_text())
    assert data["flops"] > 0 and data["intra_bandwidth"] > 0 and data["intra_latency"] > 0
    assert data["tokens_half"] >= 0 and data["width_half"] >= 0 and data["gather_factor"] > 0 < data["scatter_factor"]
    capsys.readouterr()
    (tmp_path / "tiny.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "tiny:net", "--num_processes", "2"]) == 0
    assert f"Calibration {cal}" in capsys.readouterr().out
    assert main(["plan", "tiny:net", "--num_processes", "2", "--json"]) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["flops"] == data["flops"] and hw["intra_bandwidth"] == data["intra_bandwidth"]
    for key in ("intra_latency", "tokens_half", "width_half", "gather_factor", "scatter_factor", "memory_bandwidth",
                "op_overhead", "overlap", "sync_fixed", "sync_slowdown", "run_ahead", "fsdp_call", "tp_call"):
        assert hw[key] == data[key], key
    assert data["memory_bandwidth"] > 0 and data["op_overhead"] > 0 and 0 <= data["overlap"] <= 1
    assert data["sync_fixed"] >= 0 and data["sync_slowdown"] >= 1 and data["run_ahead"] is False  # CPU
    assert data["fsdp_call"] >= 0 and data["tp_call"] >= 0
    assert hw["efficiency"] == 1.0  # a measured matmul rate is what a matmul reaches
    assert main(["plan", "tiny:net", "--flops", "7", "--json"]) == 0  # an explicit flag wins
    assert json.loads(capsys.readouterr().out)["hardware"]["flops"] == 7e12


def test_measure_runs_two_layouts_and_writes_the_fastest(tmp_path, run_accel):
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "train.py").write_text(TRAIN)
    proc = run_accel("plan", "tiny:net", "--num_processes", "2", "--batch_size", "2", "--seq_len", "4",
                     "--device_memory", "1GB", "--top", "3", "--steps", "3", "--write", "cfg.yaml", "--json",
                     "--measure", "train.py", timeout=300,  # two launches; two pytest workers share the cores
                     env={"PYTHONPATH": str(tmp_path) + ":" + ":".join(sys.path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    ran = [m for m in result["measured"] if "measured_step_time_s" in m]
    assert len(ran) == 3, result["measured"]
    assert {result["layouts"][m["index"]]["zero_stage"] for m in ran} == {0, 1}  # DDP, ZeRO-1
    for m in ran:
        assert m["measured_step_time_s"] > 0 and m["ranks"] == 2 and m["memory_kind"] == "tensors held after step"
        # on CPU: the bytes held after optimizer.step(), the estimate's model states (ZeRO-1 once read low)
        est = result["layouts"][m["index"]]["model_state_bytes_per_rank"]
        assert abs(m["measured_memory_per_rank_bytes"] / est - 1) < 0.05, (m, est)
    best = min(ran, key=lambda m: m["measured_step_time_s"])["index"]
    assert result["recommended"] == result["measured_best"] == best
    cfg = yaml.safe_load((tmp_path / "cfg.yaml").read_text())
    assert cfg["parallelism"]["zero_stage"] == result["layouts"][best]["zero_stage"]


def test_measure_gives_the_prepared_loader_the_layouts_batch(monkeypatch):
    """Under --measure a layout with gradient accumulation runs micro-batches, not the script's whole batch."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel.data.loading import prepare_data_loader
    from accel.planning.measure import MEASURE_BATCH_ENV

    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=8, shuffle=True)
    monkeypatch.setenv(MEASURE_BATCH_ENV, "2")
    batches = list(prepare_data_loader(loader, num_processes=1, process_index=0))
    assert [len(b[0]) for b in batches] == [2] * 8
    assert sorted(torch.cat([b[0] for b in batches]).tolist()) == list(range(16))
    monkeypatch.delenv(MEASURE_BATCH_ENV)
    assert [len(b[0]) for b in prepare_data_loader(loader, num_processes=1, process_index=0)] == [8, 8]
