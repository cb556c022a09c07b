"""What a launched worker sees of its interpreter, written to OUT/rank<R>.json (and OUT/exit<R>.txt by an atexit
handler, OUT/thread<R>.txt by a non-daemon thread that outlives the script):
tests/multiproc/launching/test_forked_workers.py compares a forked worker's answers with a fresh interpreter's."""

import atexit
import json
import os
import random
import signal
import sys
import threading
import time

import torch

torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # as a training script does (torch._dynamo loads)

out, rank = sys.argv[1], os.environ["RANK"]
record = {
    "name": __name__,
    "argv": sys.argv[1:],
    "argv0": os.path.basename(sys.argv[0]),
    "path0": sys.path[0],
    "main_file": os.path.basename(sys.modules["__main__"].__file__),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "random": random.random(),
    "rank_env": rank,
    "stdout_write_through": getattr(sys.stdout, "write_through", None),
    "torch_threads": torch.get_num_threads(),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(record, fh)


def late():
    time.sleep(0.5)
    with open(os.path.join(out, f"thread{rank}.txt"), "w") as fh:
        fh.write("joined")


atexit.register(lambda: open(os.path.join(out, f"exit{rank}.txt"), "w").write("ran"))
threading.Thread(target=late).start()
print(f"rank {rank} done")
sys.exit(0)
