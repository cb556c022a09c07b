"""Run Accelerate's own test scripts on accel (through the shim) and, for comparison, on Accelerate itself, on 1 and
2 CPU processes; print per test function whether it passed (on every rank) and the totals, and write them as JSON.

    python tests/accelerate_compat/measure.py --out /tmp/compat [--scripts test_ops,test_sync] [--impl accel]

A function passes when every rank recorded it as passed. A launch that hangs is stopped after --timeout seconds;
functions it had not finished count as failed ("did not finish")."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["test_script", "test_sync", "test_ops", "test_distributed_data_loop", "test_notebook", "test_ddp_comm_hook"]


def launch_command(impl: str, procs: int, script: str, out: Path, only: str = "") -> list[str]:
    runner = [str(HERE / "run_script.py"), script, str(out), only]
    if script == "test_notebook":  # it starts its own processes (ACCELERATE_NUM_PROCESSES of them)
        shim = [sys.executable, "-c", "import accel.shim, runpy, sys; accel.shim.install(); sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')"]
        return [*(shim if impl == "accel" else [sys.executable]), *runner]
    if impl == "accel":
        return [sys.executable, "-m", "accel.cli.main", "launch", "--accelerate_shim", "--cpu",
                "--num_processes", str(procs), *runner]
    # Accelerate's --cpu runs one process; --multi_gpu on a machine without GPUs is its multi-CPU (gloo) launch
    mode = "--cpu" if procs == 1 else "--multi_gpu"
    return [sys.executable, "-m", "accelerate.commands.launch", mode, "--num_processes", str(procs),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(_free_port()), *runner]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(impl: str, procs: int, script: str, out: Path, timeout: int, only: str = "") -> dict:
    """{function (with its call's arguments): "pass" | error text}, and how the launch ended."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HOME": str(out),  # no saved configs
           "ACCELERATE_NUM_PROCESSES": str(procs),  # test_notebook's number of processes
           "ACCELERATE_USE_CPU": "true"}  # Accelerate: gloo on CPU (MULTI_CPU) with its --multi_gpu launch
    # its own session, so a launch that hangs is stopped with all its workers (not only the launcher)
    proc = subprocess.Popen(launch_command(impl, procs, script, out, only), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=HERE.parents[1], start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        ended, tail = f"exit {proc.returncode}", output[-2000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        ended, tail = f"timed out after {timeout} s", (output or "")[-2000:]
    per_rank = []
    for rank in range(1 if script == "test_notebook" else procs):
        path = out / f"rank{rank}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        per_rank.append(lines)
    results: dict[str, str] = {}
    longest = max(per_rank, key=len)
    for index, entry in enumerate(longest):
        if entry["function"] == "<main finished>":
            continue
        key = f"{entry['function']}({entry.get('args', '')})"
        while key in results:
            key += "'"
        outcomes = [r[index] if index < len(r) else None for r in per_rank]
        if all(o is not None and o.get("ok") for o in outcomes):
            results[key] = "pass"
        else:
            failed = next((o for o in outcomes if o is not None and not o.get("ok")), None)
            results[key] = "did not finish" if failed is None else f"{failed['error']} [{failed.get('where', '')}]"
    return {"results": results, "ended": ended, "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scripts", default=",".join(SCRIPTS))
    parser.add_argument("--impl", default="accel,accelerate")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--timeout", type=int, default=300)
    args = parser.parse_args()
    out = Path(args.out)
    report = {}
    for impl in args.impl.split(","):
        for procs in map(int, args.procs.split(",")):
            for script in args.scripts.split(","):
                tag = f"{impl}-{procs}p-{script}"
                report[tag] = run(impl, procs, script, out / tag, args.timeout)
                results = report[tag]["results"]
                passed = sum(v == "pass" for v in results.values())
                print(f"{tag}: {passed}/{len(results)} passed ({report[tag]['ended']})", flush=True)
                for key, value in results.items():
                    if value != "pass":
                        print(f"    FAIL {key}: {value}", flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
