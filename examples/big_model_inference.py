"""Big-model inference: build a model without memory, stream its checkpoint in, run it from CPU and disk.

    python examples/big_model_inference.py
    python examples/big_model_inference.py --cpu_budget 3MB     # less on the CPU, more read from disk

A small GPT-like model (embedding tied to the output head, 6 blocks) is saved the way `accelerator.save_model`
saves it (sharded safetensors + index) into a temporary folder. It is then built again under
`init_empty_weights` (parameters on the meta device: no memory) and loaded with `load_checkpoint_and_dispatch`:
`device_map="auto"` puts the first blocks on the CPU within `--cpu_budget` and the rest on disk; disk weights are
read from the checkpoint's own files during each forward. The outputs equal the plain model's. Under `accel
launch` each process does the same on its own (nothing here is distributed).
"""

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

from accel import PartialState, init_empty_weights, load_checkpoint_and_dispatch
from accel.checkpoint.model_io import save_state_dict_sharded


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 1000, width: int = 256, depth: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: device maps keep the two together

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu_budget", default="8MB", help="max_memory for the CPU, e.g. 8MB, 6MiB")
    args = parser.parse_args()
    state = PartialState()

    torch.manual_seed(0)
    model = TinyLM().eval()
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        expected = model(ids)

    with tempfile.TemporaryDirectory() as tmp:
        save_state_dict_sharded(model.state_dict(), Path(tmp) / "model", max_shard_size="1MB")
        with init_empty_weights():
            empty = TinyLM()  # parameters on the meta device
        big = load_checkpoint_and_dispatch(
            empty, Path(tmp) / "model", device_map="auto", max_memory={"cpu": args.cpu_budget},
            no_split_module_classes=["Block"], offload_folder=Path(tmp) / "offload",
        )
        with torch.no_grad():
            output = big(ids)
        on_disk = [name for name, device in big.hf_device_map.items() if device == "disk"]

    assert torch.equal(output, expected), "dispatched model disagrees with the plain model"
    if state.is_main_process:
        params = sum(p.numel() for p in model.parameters())
        print(f"device_map: {big.hf_device_map}")
        print(f"{params:,} parameters, {len(on_disk)} of {len(big.hf_device_map)} entries read from disk; "
              f"outputs equal the plain model's; {state.num_processes} process(es)")


if __name__ == "__main__":
    main()
