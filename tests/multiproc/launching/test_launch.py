"""`accel launch` starting real processes (gloo on CPU): ranks, script args, the config channel, failures,
and two "machines" on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

pytestmark = pytest.mark.multiproc

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "launch_probe.py"
ACCEL = [sys.executable, "-m", "accel.cli.main", "launch"]


def records(out: Path) -> dict[int, dict]:
    found = {}
    for path in sorted(out.glob("rank*.json")):
        data = json.loads(path.read_text())
        found[int(data["RANK"] or 0)] = data
    return found


def test_two_processes_get_ranks_the_config_and_untouched_args(run_accel, tmp_path):
    out = tmp_path / "out"
    script_args = ["--out", str(out), "--probe-flag", "--num_processes", "7", "--cpu", "-m", "x"]
    result = run_accel("launch", "--cpu", "--num_processes", "2", "--mixed_precision", "bf16",
                       "--gradient_accumulation_steps", "4", PROBE, *script_args, timeout=120)
    assert result.returncode == 0, result.stderr
    got = records(out)
    assert sorted(got) == [0, 1]
    assert len({r["pid"] for r in got.values()}) == 2
    for rank, rec in got.items():
        assert rec["WORLD_SIZE"] == "2" and rec["LOCAL_RANK"] == str(rank)
        assert rec["argv"] == script_args
        assert rec["all_reduce_sum"] == 1.0 and rec["dist_world_size"] == 2  # 0 + 1: they are connected
        cfg = rec["config"]
        assert cfg["use_cpu"] is True and cfg["num_processes"] == 2
        assert cfg["mixed_precision"] == "bf16" and cfg["gradient_accumulation_steps"] == 4
        assert cfg["distributed_type"] == "MULTI_CPU"


def test_one_process_runs_without_torchrun_and_keeps_the_exit_code(run_accel, tmp_path):
    out = tmp_path / "single"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("mixed_precision: fp16\nparallelism:\n  tp_size: 1\n  pp_schedule: GPipe\n")
    result = run_accel("launch", "--config_file", cfg_file, "--cpu", PROBE, "--out", out, "--exit", "5",
                       timeout=60)
    assert result.returncode == 5, result.stderr  # the launcher became the script (exec)
    rec = records(out)[0]
    assert rec["RANK"] is None and rec["WORLD_SIZE"] is None and rec["TORCHELASTIC_RUN_ID"] is None
    assert rec["argv"] == ["--out", str(out), "--exit", "5"]
    cfg = rec["config"]
    assert cfg["num_processes"] == 1 and cfg["use_cpu"] is True
    assert cfg["mixed_precision"] == "fp16" and cfg["parallelism"]["pp_schedule"] == "GPipe"


def test_module_mode(run_accel, tmp_path):
    out = tmp_path / "mod"
    pkg = tmp_path / "pkgdir"
    pkg.mkdir()
    (pkg / "probe_mod.py").write_text(PROBE.read_text())
    result = run_accel("launch", "--cpu", "--num_processes", "2", "-m", "probe_mod", "--out", out,
                       env={"PYTHONPATH": str(pkg)}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(records(out)) == [0, 1]


def test_failing_worker_stops_the_group_and_sets_the_exit_code(run_accel, tmp_path):
    out = tmp_path / "fail"
    result = run_accel("launch", "--cpu", "--num_processes", "2", PROBE, "--out", out, "--fail-rank", "1",
                       timeout=90)  # rank 0 waits in an all_reduce: the agent must stop it, not hang
    assert result.returncode == 3, result.stderr
    assert "rank 1 failing on purpose" in result.stderr  # the worker's own stderr comes through
    summary = [line for line in result.stderr.splitlines() if line.startswith("accel launch: rank ")]
    assert any(line.startswith("accel launch: rank 1 ") and "exited with code 3" in line for line in summary)
    assert "accel/cli/launch.py" not in result.stderr and "torch/distributed/run.py\", line" not in result.stderr
    assert records(out) == {}


def _two_machines(tmp_path: Path, env: dict, backend: str, port: int) -> tuple[dict, list]:
    out = tmp_path / f"machines-{backend}"
    procs = [
        warm_python.Popen(
            [*ACCEL, "--cpu", "--num_machines", "2", "--num_processes", "4", "--machine_rank", str(rank),
             "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", backend,
             str(PROBE), "--out", str(out)],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            results.append((proc.returncode, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [code for code, _ in results] == [0, 0], results
    return records(out), results


def test_two_machines_static_machine_rank_is_the_node_rank(isolated_env, tmp_path, free_port):
    got, _ = _two_machines(tmp_path, isolated_env, "static", free_port)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, rec in got.items():
        assert rec["WORLD_SIZE"] == "4" and rec["LOCAL_RANK"] == str(rank % 2)
        assert rec["all_reduce_sum"] == 6.0
        assert rec["config"]["machine_rank"] == rank // 2  # machine_rank 1 -> RANK 2, 3
        assert rec["config"]["num_machines"] == 2 and rec["config"]["num_processes"] == 4


def test_two_machines_c10d(isolated_env, tmp_path, free_port):
    got, _ = _two_machines(tmp_path, isolated_env, "c10d", free_port)
    assert sorted(got) == [0, 1, 2, 3]
    assert all(rec["all_reduce_sum"] == 6.0 for rec in got.values())
    # node ranks follow arrival order, but each machine's two workers are consecutive ranks
    for node in (0, 1):
        assert got[2 * node]["config"]["machine_rank"] == got[2 * node + 1]["config"]["machine_rank"]
