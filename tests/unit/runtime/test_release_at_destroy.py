"""The end of a run drops each DDP reducer before the process group goes: a reducer that outlives its group made
ranks abort at exit (accel.state.PartialState.destroy, accel.backends.ddp.release_ddp)."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accel import Accelerator
from accel.parallel.data_parallel import DataParallelPlan
from accel.state import PartialState


@pytest.fixture
def group_of_one(tmp_path, monkeypatch):
    """A gloo group of world size 1 that the state owns and destroys, as it does when it creates one for several
    processes; the state is new before and gone after."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    PartialState._reset_for_tests()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        PartialState._reset_for_tests()


def test_ddp_reducers_are_released_before_the_group_is_destroyed(group_of_one, monkeypatch):
    accelerator = Accelerator(cpu=True)
    accelerator.state._owns_group = True  # as after PartialState's own init_process_group
    accelerator.backend.data_parallel = DataParallelPlan("ddp")  # what the backend decides with several processes
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    assert isinstance(model, DDP) and model.reducer is not None

    reducer_when_destroyed = []
    destroy = dist.destroy_process_group

    def recording_destroy(group=None):
        reducer_when_destroyed.append(model.__dict__.get("reducer"))
        destroy(group)

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    accelerator.state.destroy()
    assert reducer_when_destroyed == [None], "the process group was destroyed while a DDP reducer still held it"
    assert not dist.is_initialized()
