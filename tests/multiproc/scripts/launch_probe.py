"""A worker for the `accel launch` tests: writes what it was given to <out>/rank<RANK>.json.

Uses only the standard library and torch.distributed (not accel.Accelerator). With several processes it joins
a gloo process group and all-reduces its rank, which proves the workers are connected.
Options it reads (every argument is also recorded raw): --out DIR, --fail-rank R (that rank exits 3 after
joining the group, while the others wait in an all_reduce), --exit N (exit code after writing).
"""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--out", required=True)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--exit", type=int, default=0, help="exit code after writing the record")
known, _ = parser.parse_known_args()

record = {
    "argv": sys.argv[1:],
    "RANK": os.environ.get("RANK"),
    "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
    "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
    "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE"),
    "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID"),
    "config": json.loads(os.environ["ACCEL_LAUNCH_CONFIG"]) if "ACCEL_LAUNCH_CONFIG" in os.environ else None,
    "pid": os.getpid(),
}

rank = int(record["RANK"] or 0)
if record["WORLD_SIZE"] is not None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if known.fail_rank == rank:
        sys.stderr.write(f"launch_probe: rank {rank} failing on purpose\n")
        sys.stderr.flush()
        os._exit(3)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    record["all_reduce_sum"] = value.item()
    record["dist_world_size"] = dist.get_world_size()
    dist.destroy_process_group()

os.makedirs(known.out, exist_ok=True)
tmp = os.path.join(known.out, f".rank{rank}.tmp")
with open(tmp, "w") as fh:
    json.dump(record, fh)
os.replace(tmp, os.path.join(known.out, f"rank{rank}.json"))
sys.exit(known.exit)
