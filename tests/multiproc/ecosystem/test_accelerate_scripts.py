"""Accelerate's own test scripts (accelerate 1.15's `test_utils/scripts`), unchanged, on accel through the shim
(`accel launch --accelerate_shim`), on 1 and 2 CPU processes, one result per test function their `main()` calls
(tests/accelerate_compat/measure.py; the table and the reasons are in docs/accelerate_compat.md).

Each case checks the exact set of functions that fail, so a regression fails here and so does a fixed gap (update
the set and the docs). The gaps left are listed with their reason."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
if importlib.util.find_spec("accelerate") is None:
    pytest.skip("the real accelerate package (a test extra) is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "accelerate_compat"))
import measure  # noqa: E402
import warm_python

from accel.cli.launch import port_in_use  # noqa: E402

GAPS = {  # function -> why it fails on accel (reached on accel only: Accelerate hangs before it on CPU)
    "test_stateful_dataloader_save_state": "each process saves to its own temporary folder; an accel checkpoint is "
                                           "one folder that every process shares (docs/accelerate_compat.md)",
}
ONE_PROCESS = {  # fails on one process on Accelerate too (and on accel, for the same reason)
    "create_accelerator": "test_distributed_data_loop on one process asserts two GPUs",
    "test_monitoring": "needs 2 processes; with 1 the function raises in-process, as on Accelerate",
}
CASES = [("test_script", 1, ""), ("test_script", 2, ""), ("test_sync", 1, ""), ("test_sync", 2, ""),
         ("test_ops", 1, ""), ("test_ops", 2, ""), ("test_distributed_data_loop", 2, ""),
         ("test_notebook", 2, "")]


@pytest.mark.parametrize("script,procs,only", CASES, ids=[f"{s}-{p}p" for s, p, _ in CASES])
def test_accelerate_script_on_accel(tmp_path, script, procs, only):
    if script == "test_notebook" and port_in_use(29500):
        pytest.skip("port 29500, which test_notebook's static rendezvous uses (Accelerate's default), is taken")
    report = measure.run("accel", procs, script, tmp_path / script, timeout=240, only=only)
    results = report["results"]
    assert results, f"nothing ran ({report['ended']}):\n{report['tail']}"
    failed = {key.split("(")[0]: value for key, value in results.items() if value != "pass"}
    known = GAPS | (ONE_PROCESS if procs == 1 else {})
    expected = {name for name in known if any(key.startswith(name + "(") for key in results)}
    assert set(failed) == expected, failed
    if only:
        assert {key.split("(")[0] for key in results} == set(only.split(","))


def test_nlp_example_runs_unmodified_through_the_shim(isolated_env):
    """Accelerate's nlp_example.py shape (BERT, AdamW, warm-up, accumulation, gather_for_metrics), importing only
    `accelerate`: with the real Accelerate installed, transformers also imports `accelerate.utils` names, which the
    shim must provide."""
    from _launch import accel_launch

    script = Path(__file__).resolve().parents[2] / "accelerate_compat" / "nlp_example.py"
    out = accel_launch({**isolated_env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
                       "--accelerate_shim", "--cpu", "--num_processes", 2, script, timeout=300).stdout
    assert out.count("on 100 eval samples, 2 processes, MULTI_CPU") == 3  # one line per epoch, main process only


def _sum_ranks(out_dir):
    import torch

    from accel import PartialState
    from accel.runtime.ops import reduce

    state = PartialState()
    total = reduce(torch.tensor([float(state.process_index)]), "sum")
    Path(out_dir, f"rank{state.process_index}").write_text(f"{state.num_processes} {total.item()}")


@pytest.mark.parametrize("launcher", ["debug_launcher", "notebook_launcher"])
def test_launchers_fork_a_gloo_group(tmp_path, launcher):
    """debug_launcher / notebook_launcher (torch's elastic_launch, forked workers): 2 processes in one gloo group, also
    when this process already has its own (one-process) state, which the forked workers must not inherit."""
    import accel

    accel.PartialState()

    if launcher == "notebook_launcher":
        if port_in_use(29500):
            pytest.skip("port 29500 (notebook_launcher's default use_port) is taken")
        accel.notebook_launcher(_sum_ranks, (str(tmp_path),), num_processes=2)
    else:
        accel.debug_launcher(_sum_ranks, (str(tmp_path),))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["2 1.0", "2 1.0"]


MERGE_GAPS = {  # test_merge_weights.py's functions that fail on accel, and why (the merge itself is exact:
    # tests/multiproc/checkpoints/test_merge_weights.py)
    "test_merge_weights_safetensors": "its check compares model.state_dict() with torch.allclose: under accel's FSDP2 "
                                      "that state dict holds DTensor shards (FSDP1's default FULL_STATE_DICT gives "
                                      "full tensors), and allclose(DTensor, Tensor) raises",
    "test_merge_weights_command_safetensors": "the same check as test_merge_weights_safetensors",
    "test_merge_weights_pytorch": "it reads pytorch_model.bin with torch.load: accel never writes pickle files "
                                  "(safe_serialization=False still writes model.safetensors)",
    "test_merge_weights_command_pytorch": "--unsafe_serialization: the same as test_merge_weights_pytorch",
}
MERGE_SETUP_GAP = "FullyShardedDataParallelPlugin.set_auto_wrap_policy"  # until accel's plugin has it, setup() fails


def test_merge_weights_script_on_accel(isolated_env, tmp_path):
    """Accelerate's test_merge_weights.py (its work is in its `__main__` block) on 2 processes: trains FSDP
    FULL_SHARD, save_fsdp_model(SHARDED_STATE_DICT), then merges with merge_fsdp_weights and merge_command."""
    from _launch import SCRIPTS

    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--accelerate_shim", "--cpu", "--num_processes", "2",
           str(SCRIPTS / "run_main_block.py"), "accelerate.test_utils.scripts.test_merge_weights",
           str(tmp_path / "out")]
    proc = warm_python.run(cmd, cwd=tmp_path, env={**isolated_env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                           timeout=240)
    ranks = [[json.loads(line) for line in (tmp_path / "out" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(2)]
    failed = {e["function"] for rank in ranks for e in rank if not e["ok"] and not e["function"].startswith("<")}
    setup = [e for rank in ranks for e in rank if e["function"] == "setup"]
    if setup and not setup[0]["ok"] and MERGE_SETUP_GAP.split(".")[1] in setup[0]["error"]:
        assert failed == {"setup"}, (failed, proc.stderr[-2000:])
        return
    assert failed == set(MERGE_GAPS), (failed, proc.stderr[-2000:])
    assert all(rank[-1]["function"] == "<main finished>" for rank in ranks), proc.stderr[-2000:]
    assert (tmp_path / "test_merge_weights_fsdp_weights").exists() is False  # the script cleaned up after itself
