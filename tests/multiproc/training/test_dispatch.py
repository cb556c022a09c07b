"""dispatch_batches (Accelerate's `DataLoaderDispatcher`) on 2 CPU processes, one launch: the main process reads,
every rank trains on its slice. Checked against one process of plain PyTorch on the global batches (weights within
atol 1e-6), against the orders Accelerate's rules give (exact), and against Accelerate's layout of an uneven last round."""

import json

import pytest
import torch
from _launch import SCRIPTS, accel_launch, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("dispatch")
    accel_launch(make_isolated_env(out), "--cpu", "--num_processes", 2, SCRIPTS / "dispatch_train.py", out,
                 timeout=240)
    return out, json.loads((out / "results.json").read_text())


def test_training_on_a_dispatched_stream_matches_one_process(run):
    out, results = run
    script = worker_module("dispatch_train")
    model = script.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = list(script.Stream())
    for _ in range(2):  # global batches of 8; the last round (4 rows) is split 2 + 2
        for start in range(0, len(rows), 8):
            part = rows[start:start + 8]
            x, y = torch.stack([r[0] for r in part]), torch.stack([r[1] for r in part])
            half = len(part) // 2  # each rank's mean loss, averaged over ranks by DDP
            loss = 0.5 * (torch.nn.functional.mse_loss(model(x[:half]), y[:half])
                          + torch.nn.functional.mse_loss(model(x[half:]), y[half:]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    weights = load_file(str(out / "weights.safetensors"))
    for key, value in model.state_dict().items():
        assert torch.allclose(weights[key], value, atol=1e-6), key
    assert results["metrics_rows"] == [float(i) for i in range(44)]  # rank 0's rows only, in order, none twice


def test_dispatched_and_sharded_orders_follow_the_users_generator_as_in_accelerate(run):
    """DataLoader(shuffle=True, generator=g): sharded, each pass first draws the workers' base seed from g (the
    loader's generator), then the permutation; dispatched, Accelerate drops the generator from the base loader, so the
    base seed comes from the global RNG and the permutations are g's own."""
    _, results = run
    g = torch.Generator().manual_seed(7)
    dispatched = [list(torch.utils.data.RandomSampler(range(30), generator=g)) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    sharded = []
    for _ in range(2):
        torch.empty((), dtype=torch.int64).random_(generator=g)
        sharded.append(list(torch.utils.data.RandomSampler(range(30), generator=g)))
    for name, expected in (("dispatched", dispatched), ("sharded", sharded)):
        got = results[name]["epochs"]
        assert [[i for batch in epoch for i in batch] for epoch in got] == expected, name


def test_uneven_last_round_is_padded_as_accelerate_does(run):
    _, results = run
    # 13 rows, batch 4, 2 processes: rounds of 8, then 4 + 1 rows = 5, padded with the epoch's first 2 rows -> 3 each
    assert results["tail_splitFalse"] == [list(range(8)), [8, 9, 10, 11, 12, 0]]
    # split_batches: one batch of 4 per round, 2 rows each; the last batch (1 row) padded to 3 rows -> 1 row each
    assert results["tail_splitTrue"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 0]]


@pytest.mark.parametrize("dispatch", [False, True])
def test_stateful_loader_resumes_mid_epoch_without_skipping(run, dispatch):
    """use_stateful_dataloader=True (torchdata): save_state after batch 4 (mid-epoch) or 6 (the first epoch's last),
    load_state in a fresh Accelerator: the batches seen before and after, joined, equal an uninterrupted run."""
    pytest.importorskip("torchdata")
    _, results = run
    got = results[f"stateful_dispatch{dispatch}"]
    assert len(got["full"]) == 12 and got["full"][:6] != got["full"][6:]
    for stop, joined in got["cuts"].items():
        assert joined == got["full"], f"cut after batch {stop}"


def test_save_state_refuses_a_folder_per_process(run):
    """Accelerate's test_distributed_data_loop saves to a tempfile folder per process; an accel checkpoint is one
    folder that every process writes its part of, so that is one line naming each rank's folder, on every rank."""
    _, results = run
    assert results["own_folders"].startswith("save_state: the processes named different folders (rank 0: ")
