"""Accelerate's `DataLoaderShard(..., use_stateful_dataloader=True)` / `DataLoaderDispatcher(...)`: built on
torchdata's StatefulDataLoader, resuming mid-epoch from state_dict() as torchdata's own loader does."""

from __future__ import annotations

import pytest

pytest.importorskip("torchdata.stateful_dataloader")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from accel.data.loading import DataLoaderDispatcher, DataLoaderShard  # noqa: E402


@pytest.mark.parametrize("cls", [DataLoaderShard, DataLoaderDispatcher])
def test_stateful_constructor_resumes_like_torchdata(cls):
    loader = cls(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    assert isinstance(loader, cls) and isinstance(loader, StatefulDataLoader) and loader.use_stateful_dataloader
    assert not cls(list(range(16)), batch_size=4).use_stateful_dataloader
    reference = StatefulDataLoader(list(range(16)), batch_size=4)
    for dl in (loader, reference):
        it = iter(dl)
        next(it), next(it)
    state, ref_state = loader.state_dict(), reference.state_dict()
    resumed = cls(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    resumed.load_state_dict(state)
    ref_resumed = StatefulDataLoader(list(range(16)), batch_size=4)
    ref_resumed.load_state_dict(ref_state)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in ref_resumed] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_stateful_skip_loader_skips_and_resumes_like_torchdata():
    from accel.data.loading import SkipDataLoader

    loader = SkipDataLoader(list(range(16)), batch_size=4, skip_batches=1, use_stateful_dataloader=True)
    assert isinstance(loader, SkipDataLoader) and isinstance(loader, StatefulDataLoader)
    assert loader.base_dataloader is loader and not isinstance(SkipDataLoader([1], batch_size=1), StatefulDataLoader)
    it = iter(loader)
    assert next(it).tolist() == [4, 5, 6, 7]
    state = loader.state_dict()  # torchdata's: the skipped batch was read too
    resumed = SkipDataLoader(list(range(16)), batch_size=4, use_stateful_dataloader=True)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[8, 9, 10, 11], [12, 13, 14, 15]]
