"""An Accelerate-style script that logs through experiment trackers. argv: OUT LOG_WITH (comma-separated names).

Under `accel launch --accelerate_shim` on 2 processes it runs on accel; as `python tracking_worker.py` it runs on
the real Accelerate (the reference). Each process writes OUT/rank<i>.json (its pid and what it sees of the trackers);
`Marker` trackers write OUT/<name>-<rank> for each `log` they get, showing where a tracker's methods run.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, on_main_process

STEPS = 4
CONFIG = {"lr": 0.1, "batch_size": 8, "optimizer": "adamw"}


def values(step: int) -> dict:
    return {"loss": torch.tensor(1.0 / (step + 1)), "lr": 0.1 * 0.5 ** step, "phase": "train",
            "eval": {"acc": step / 4}}


class Marker(GeneralTracker):
    requires_logging_directory = False

    def __init__(self, out: Path, name: str, main_process_only: bool):
        self.out, self.name, self.main_process_only = out, name, main_process_only
        super().__init__()  # checks name, requires_logging_directory, tracker

    @property
    def tracker(self):
        return self.out

    @on_main_process
    def log(self, values, step=None, **kwargs):
        with open(self.out / f"{self.name}-{os.environ.get('RANK', '0')}", "a") as out:
            out.write(f"{step}\n")


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    everywhere = Marker(out, "in-log-with-everywhere", main_process_only=False)
    accelerator = Accelerator(log_with=[*names, everywhere], project_dir=str(out))
    accelerator.init_trackers("tracking", config=CONFIG, init_kwargs={"wandb": {"dir": str(out)}})
    for step in range(STEPS):
        accelerator.log(values(step), step=step)
        for direct in (Marker(out, "direct-everywhere", False), Marker(out, "direct-main", True)):
            direct.log({}, step=step)  # a tracker used directly: on_main_process honours main_process_only
    seen = {"pid": os.getpid(), "trackers": [t.name for t in accelerator.trackers],
            "get_tracker": type(accelerator.get_tracker("tensorboard")).__name__}
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(seen))
    accelerator.end_training()


if __name__ == "__main__":
    main()
