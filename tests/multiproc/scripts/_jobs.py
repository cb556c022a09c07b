"""`--jobs FILE` for the worker scripts: several runs in one launch, one after another (FILE: a JSON list of argument
lists, each with its own --out), one Accelerator each, the process group kept between them. Launching costs more than
most runs (every process imports torch), so tests whose runs succeed share one launch (_launch.launch_jobs)."""

import json
import sys
from pathlib import Path


def main_with_jobs(run) -> None:
    """`run(argv)` (argv None: the command line) trains one job and returns its Accelerator."""
    if sys.argv[1:2] != ["--jobs"]:
        run(None).end_training()
        return
    jobs = json.loads(Path(sys.argv[2]).read_text())
    for i, argv in enumerate(jobs):
        accelerator = run(argv)
        if i < len(jobs) - 1:
            accelerator.free_memory()
    accelerator.end_training()
