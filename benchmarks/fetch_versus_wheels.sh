#!/usr/bin/env bash
# Download what `benchmarks/versus.py` and `benchmarks/bench_step.py` need beyond torch, transformers and torchao into
# benchmarks/wheels/ (git-ignored; about 3.5 MB), so a GPU machine without a network can install it: both install from
# there, with `pip install --no-index --no-deps --target benchmarks/wheels/site`, each package this Python lacks or has
# older, and run the peers with that folder first on sys.path (accel's `accelerate` shim stays out of their way).
#
#   bash benchmarks/fetch_versus_wheels.sh [folder]
#
# Every wheel is fetched with --no-deps: torchtitan 0.3.0 pulls torch (torch_checkpointing needs torch>=2.11, and pip
# would take the newest) and datasets (pyarrow, pandas: ~60 MB of binaries for a data loader this comparison does not
# use; versus.py puts a stand-in in its place when it is absent). Fabric is `lightning_fabric`, the standalone
# distribution of `lightning.fabric` (`import lightning` also imports lightning.pytorch: torchmetrics and more).
# Pure-Python wheels only (py3-none-any), so the folder serves any CPU architecture and Python >= 3.11 on the GPU
# machine.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${1:-$here/wheels}"
mkdir -p "$dest"
rm -rf "$dest/site"  # installed for this machine's Python by versus.py or bench_step.py; each machine installs its own
packages=(
  torchtitan==0.3.0            # the peer
  accelerate==1.15.0           # the peer
  spmd_types==0.2.3            # torchtitan: imported by its trainer (pinned by torchtitan)
  torch_checkpointing==0.1.1   # torchtitan: its checkpointer, imported by the trainer
  torchdata==0.11.0            # torchtitan: StatefulDataLoader, imported by its data loader base class
  tyro==1.0.17                 # torchtitan: its config system
  docstring_parser==0.18.0     # tyro
  typeguard==4.6.1             # tyro
  typing_extensions==4.16.0    # typeguard needs >= 4.14 (installed only where this Python's is older)
  lightning_fabric==2.6.6      # bench_step.py's peer: Lightning Fabric
  lightning_utilities==0.15.3  # lightning_fabric
)
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --dest "$dest" "${packages[@]}" \
  2>&1 | { grep -v "^WARNING: Location" || true; }
ls -l "$dest"/*.whl | awk '{printf "%8.0f kB  %s\n", $5 / 1024, $NF}'
du -sh "$dest" | awk '{print "total " $1}'
