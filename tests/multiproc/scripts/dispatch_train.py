"""dispatch_batches on N processes: only the main process reads the data (each rank's stream differs here, so any
batch read elsewhere would show), every rank gets its slice. Writes to OUT_DIR: the gathered batch sequences of
several loaders (rank 0) and the weights trained on a dispatched iterable stream."""

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.utils.data import DataLoader, IterableDataset

from accel import Accelerator
from accel.data.loading import DataLoaderConfiguration, DataLoaderDispatcher

ROWS = 44  # 5 full rounds of 8 and an uneven last one on 2 processes with batch 4


class Stream(IterableDataset):
    """Rows (x, y) of a fixed regression problem; rank r > 0 would read a shifted copy."""

    def __init__(self, rows: int = ROWS):
        self.rows = rows

    def __len__(self):
        return self.rows

    def __iter__(self):
        shift = 1000.0 * (dist.get_rank() if dist.is_initialized() else 0)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.rows, 3, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
        for i in range(self.rows):
            yield torch.cat([x[i], torch.tensor([float(i)])]) + shift, y[i]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def stateful_resume(out: Path, dispatch: bool) -> dict:
    """use_stateful_dataloader: two epochs in one go, and the same cut by save_state after batch `stop` (mid-epoch,
    and after the first epoch's last batch) and resumed by load_state in a new Accelerator, with no skipping."""

    def run(stop=None, resume=None):
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                    dispatch_batches=dispatch))
        dl = acc.prepare(DataLoader(list(range(22)), batch_size=2, shuffle=True,
                                    generator=torch.Generator().manual_seed(3)))
        if resume:
            acc.load_state(out / "stateful")
        seen = []
        for _ in range(2):
            for batch in dl:
                seen.append(acc.gather(batch).tolist())
                if len(seen) == stop:
                    acc.save_state(out / "stateful")
                    return seen
        return seen

    full = run()
    cuts = {}
    for stop in (4, len(full) // 2):
        cuts[stop] = run(stop) + run(resume=True)
    return {"full": full, "cuts": cuts}


def main(out: Path) -> None:
    accelerator = Accelerator()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Stream(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert isinstance(loader, DataLoaderDispatcher), type(loader)  # Accelerate's default for iterable datasets
    seen = []
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if epoch == 0:
                seen += accelerator.gather_for_metrics(x)[:, 3].tolist()
    state = {k: v.detach().cpu().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    results = {"metrics_rows": seen}
    # map-style, shuffled with the user's generator: dispatching gives the same global order as sharding
    for name, dispatch in (("sharded", False), ("dispatched", True)):
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        dl = acc.prepare(DataLoader(list(range(30)), batch_size=3, shuffle=True,
                                    generator=torch.Generator().manual_seed(7)))
        epochs = [[acc.gather(b).tolist() for b in dl] for _ in range(2)]
        resumed = [acc.gather(b).tolist() for b in acc.skip_first_batches(dl, 2)]
        results[name] = {"epochs": epochs, "resumed": resumed, "len": len(dl)}
    for split in (False, True):
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split))
        dl = acc.prepare_data_loader(DataLoader(Stream(13), batch_size=4))
        results[f"tail_split{split}"] = [acc.gather(b[0][:, 3]).tolist() for b in dl]
    for dispatch in (False, True) if importlib.util.find_spec("torchdata") else ():  # an optional extra
        results[f"stateful_dispatch{dispatch}"] = stateful_resume(out, dispatch)
    import tempfile

    from accel.checkpoint.layout import CheckpointError

    with tempfile.TemporaryDirectory() as own:  # each process its own folder: refused the same way on every rank
        try:
            accelerator.save_state(own)
            results["own_folders"] = "saved"
        except CheckpointError as error:
            results["own_folders"] = str(error)
    if accelerator.is_main_process:
        save_file(state, str(out / "weights.safetensors"))
        (out / "results.json").write_text(json.dumps(results))
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
