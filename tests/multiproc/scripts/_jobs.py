"""`--jobs FILE` for the worker scripts: several runs in one launch, one after another (FILE: a JSON list of argument
lists, each with its own --out), one Accelerator each, the process group kept between them. Launching costs more than
most runs (every process imports torch), so tests whose runs succeed share one launch (_launch.launch_jobs)."""

import gc
import json
import sys
from pathlib import Path


def main_with_jobs(run) -> None:
    """`run(argv)` (argv None: the command line) trains one job and returns its Accelerator."""
    gc.freeze()  # the script's imports live to the end: the collections of free_memory and the teardown skip them
    if sys.argv[1:2] != ["--jobs"]:
        run(None).end_training()
        return
    jobs = json.loads(Path(sys.argv[2]).read_text())
    for i, argv in enumerate(jobs):
        accelerator = run(argv)
        if i < len(jobs) - 1:
            accelerator.free_memory()
            del accelerator
            set_aside_survivors()  # what the job imported lazily (FSDP2, DTensor, checkpointing) lives to the end
    accelerator.end_training()


def set_aside_survivors() -> None:
    """Collect, then freeze what is left, so that later collections walk only the objects made after this point (a
    full collection walks the few hundred thousand objects of torch and transformers: 0.3 s each time, measured).
    Only live objects are frozen; a DDP wrapper frozen alive is still released at the teardown (the backend holds it
    weakly and drops its reducer before the process group goes)."""
    gc.collect()
    gc.freeze()
