"""Sharded data loaders, with N ranks simulated in one process by preparing the same loader N times."""

import random

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler

from accel.runtime.accumulation import GradientState
from accel.data.loading import (
    DataLoaderConfiguration,
    DataLoaderShard,
    IterableDatasetShard,
    prepare_data_loader,
    skip_first_batches,
)


class Numbers(Dataset):
    """Item i is tensor(i); counts loads so tests can tell whether skipped data was read."""

    def __init__(self, n):
        self.n = n
        self.loaded = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor(i)


class NumberStream(IterableDataset):
    def __init__(self, n):
        self.n = n
        self.epochs = []

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(torch.tensor(i) for i in range(self.n))


def shard_all(loader, n, **kwargs):
    return [prepare_data_loader(loader, num_processes=n, process_index=r, **kwargs) for r in range(n)]


def batches(loader):
    return [b.tolist() for b in loader]


def flatten(list_of_batches):
    return [i for b in list_of_batches for i in b]


# ------------------------------------------------------------------------------------------------------
# Sharding
# ------------------------------------------------------------------------------------------------------
def test_shards_are_disjoint_and_cover_the_dataset():
    loaders = shard_all(DataLoader(Numbers(24), batch_size=3, shuffle=True), 4, seed=5)
    seen = [flatten(batches(dl)) for dl in loaders]
    assert all(len(s) == 6 for s in seen)
    assert sorted(flatten(seen)) == list(range(24))


def test_round_robin_equals_one_process_with_n_times_the_batch():
    n, b, size, seed = 3, 2, 23, 7
    loader = DataLoader(Numbers(size), batch_size=b, shuffle=True)
    per_rank = [batches(dl) for dl in shard_all(loader, n, seed=seed)]
    single = batches(prepare_data_loader(DataLoader(Numbers(size), batch_size=n * b, shuffle=True), seed=seed))

    perm = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    assert flatten(single) == perm
    assert len(per_rank[0]) == len(single)
    for step, big in enumerate(single):
        together = flatten(rank[step] for rank in per_rank)  # rank order = concatenation order
        assert together[: len(big)] == big
        if step < len(single) - 1:
            assert together == big


def test_sequential_order_is_kept():
    loaders = shard_all(DataLoader(Numbers(8), batch_size=2), 2)
    assert batches(loaders[0]) == [[0, 1], [4, 5]]
    assert batches(loaders[1]) == [[2, 3], [6, 7]]


def test_shuffle_depends_only_on_seed_and_epoch():
    make = lambda seed: prepare_data_loader(DataLoader(Numbers(32), batch_size=4, shuffle=True), seed=seed)
    a, b = make(3), make(3)
    epoch0 = batches(a)
    assert epoch0 == batches(b)
    assert a.iteration == 1
    epoch1 = batches(a)
    assert epoch1 != epoch0
    assert sorted(flatten(epoch1)) == list(range(32))
    assert batches(make(4)) != epoch0
    a.set_epoch(0)
    assert batches(a) == epoch0
    expected = torch.randperm(32, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    assert flatten(epoch1) == expected


def test_set_epoch_reaches_an_iterable_dataset():
    stream = NumberStream(4)
    dl = prepare_data_loader(DataLoader(stream, batch_size=2))
    dl.set_epoch(5)
    assert stream.epochs[-1] == 5
    list(dl)
    assert stream.epochs[-1] == 5 and dl.iteration == 6
    list(dl)
    assert stream.epochs[-1] == 6


def test_set_epoch_reaches_the_sampler_of_a_loader_built_on_a_user_batch_sampler():
    """A DataLoaderShard built directly over a user's batch sampler passes set_epoch to that sampler's sampler, as
    Accelerate's does, and a skip_first_batches view of it keeps that epoch (it does not start the sampler over)."""

    class EpochSampler(Sampler):
        def __init__(self, n):
            self.n, self.epoch = n, 0

        def __iter__(self):
            return iter(range(self.n))

        def __len__(self):
            return self.n

        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler = EpochSampler(16)
    dl = DataLoaderShard(list(range(16)), batch_sampler=BatchSampler(sampler, batch_size=4, drop_last=False))
    dl.set_epoch(3)
    assert sampler.epoch == 3
    rest = skip_first_batches(dl, 2)
    assert len(rest) == 2 and next(iter(rest)).tolist() == [8, 9, 10, 11]
    assert sampler.epoch == 3


def test_even_batches_pads_by_wrapping_around_the_epoch():
    loader = DataLoader(Numbers(13), batch_size=4, shuffle=True)
    r0, r1 = (batches(dl) for dl in shard_all(loader, 2, seed=1))
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(1)).tolist()
    assert r0 == [perm[0:4], perm[8:12]]
    assert r1 == [perm[4:8], [perm[12]] + perm[0:3]]


def test_even_batches_pads_missing_batches_of_the_last_round():
    r0, r1, r2 = (batches(dl) for dl in shard_all(DataLoader(Numbers(10), batch_size=3), 3))
    assert r0 == [[0, 1, 2], [9, 0, 1]]
    assert r1 == [[3, 4, 5], [2, 3, 4]]
    assert r2 == [[6, 7, 8], [5, 6, 7]]


def test_uneven_batches_when_even_batches_is_off():
    r0, r1 = (batches(dl) for dl in shard_all(DataLoader(Numbers(13), batch_size=4), 2, even_batches=False))
    assert r0 == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert r1 == [[4, 5, 6, 7], [12]]
    counts = [len(batches(dl)) for dl in shard_all(DataLoader(Numbers(10), batch_size=3), 3, even_batches=False)]
    assert counts == [2, 1, 1]


def test_drop_last_drops_the_short_batch_and_the_incomplete_round():
    loaders = shard_all(DataLoader(Numbers(13), batch_size=4, drop_last=True), 2)
    assert [batches(dl) for dl in loaders] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert all(dl.drop_last and len(dl) == 1 for dl in loaders)


def test_split_batches_cuts_each_batch_into_contiguous_parts():
    loader = DataLoader(Numbers(14), batch_size=4)
    r0, r1 = (batches(dl) for dl in shard_all(loader, 2, split_batches=True))
    assert r0 == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert r1 == [[2, 3], [6, 7], [10, 11], [0, 1]]  # last batch [12, 13] padded from the epoch start
    dl = prepare_data_loader(loader, num_processes=2, split_batches=True)
    assert dl.batch_size == 2 and dl.total_batch_size == 4


def test_split_batches_requires_divisible_batch_size():
    with pytest.raises(ValueError, match=r"batch_size \(3\).*num_processes \(2\)"):
        prepare_data_loader(DataLoader(Numbers(12), batch_size=3), num_processes=2, split_batches=True)
    with pytest.raises(ValueError, match=r"batch_size \(3\).*num_processes \(2\)"):
        prepare_data_loader(DataLoader(NumberStream(12), batch_size=3), num_processes=2, split_batches=True)


def test_iterable_dataset_shards_chunks():
    stream = DataLoader(NumberStream(13), batch_size=4)
    r0, r1 = (batches(dl) for dl in shard_all(stream, 2))
    assert r0 == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert r1 == [[4, 5, 6, 7], [12, 0, 1, 2]]
    loaders = shard_all(stream, 2)
    assert isinstance(loaders[0].dataset, IterableDatasetShard) and [len(dl) for dl in loaders] == [2, 2]


def test_iterable_dataset_drop_last_uneven_and_split():
    dropped = [batches(dl) for dl in shard_all(DataLoader(NumberStream(13), batch_size=4, drop_last=True), 2)]
    assert dropped == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    uneven = [batches(dl) for dl in shard_all(DataLoader(NumberStream(13), batch_size=4), 2, even_batches=False)]
    assert uneven == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12]]]
    split = [batches(dl) for dl in shard_all(DataLoader(NumberStream(6), batch_size=4), 2, split_batches=True)]
    assert split == [[[0, 1], [4, 5]], [[2, 3], [0, 1]]]


class Reversed(Sampler):
    def __init__(self, n):
        self.n = n
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


class Uneven(Sampler):
    """A custom batch sampler with variable batch sizes."""

    def __iter__(self):
        return iter([[0], [1, 2], [3, 4, 5], [6]])

    def __len__(self):
        return 4


def test_custom_sampler_is_kept_and_sharded_round_robin():
    sampler = Reversed(8)
    loaders = shard_all(DataLoader(Numbers(8), batch_size=2, sampler=sampler), 2)
    loaders[0].set_epoch(3)
    assert batches(loaders[0]) == [[7, 6], [3, 2]]
    assert sampler.epochs[-1] == 3
    assert batches(loaders[1]) == [[5, 4], [1, 0]]


def test_custom_batch_sampler_pads_with_whole_batches():
    loaders = shard_all(DataLoader(Numbers(7), batch_sampler=Uneven()), 3)
    assert [batches(dl) for dl in loaders] == [[[0], [6]], [[1, 2], [0]], [[3, 4, 5], [1, 2]]]
    assert [len(dl) for dl in loaders] == [2, 2, 2]
    loaders = shard_all(DataLoader(Numbers(7), batch_sampler=Uneven()), 3, even_batches=False)
    assert [batches(dl) for dl in loaders] == [[[0], [6]], [[1, 2]], [[3, 4, 5]]]
    assert [len(dl) for dl in loaders] == [2, 1, 1]


def test_unbatched_loader_is_sharded_per_sample():
    r0, r1 = shard_all(DataLoader(Numbers(5), batch_size=None), 2)
    assert [x.item() for x in r0] == [0, 2, 4] and [x.item() for x in r1] == [1, 3, 0]
    assert r0.batch_size is None and len(r1) == 3


CONFIGS = [
    dict(size=13, batch_size=4, n=2),
    dict(size=10, batch_size=3, n=3),
    dict(size=8, batch_size=4, n=2),
    dict(size=3, batch_size=4, n=2),
    dict(size=13, batch_size=4, n=2, drop_last=True),
    dict(size=13, batch_size=4, n=2, even_batches=False),
    dict(size=10, batch_size=3, n=4, even_batches=False),
    dict(size=14, batch_size=4, n=2, split_batches=True),
    dict(size=13, batch_size=4, n=4, split_batches=True, even_batches=False),
    dict(size=13, batch_size=4, n=1),
]


@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_len_matches_the_number_of_batches(cfg, iterable):
    dataset = NumberStream(cfg["size"]) if iterable else Numbers(cfg["size"])
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], drop_last=cfg.get("drop_last", False))
    extra = {k: cfg[k] for k in ("split_batches", "even_batches") if k in cfg}
    for dl in shard_all(loader, cfg["n"], **extra):
        assert len(dl) == len(batches(dl))


def test_total_sizes():
    dl = prepare_data_loader(DataLoader(Numbers(13), batch_size=4), num_processes=3, process_index=1)
    assert dl.batch_size == 4 and dl.total_batch_size == 12 and dl.total_dataset_length == 13
    stream = prepare_data_loader(DataLoader(NumberStream(9), batch_size=2), num_processes=2)
    assert stream.total_batch_size == 4 and stream.total_dataset_length == 9


def test_settings_of_the_original_loader_are_kept():
    collate = lambda items: torch.stack(items) * 10
    init = lambda worker_id: None
    original = DataLoader(
        Numbers(4), batch_size=2, collate_fn=collate, worker_init_fn=init, timeout=7, num_workers=2,
        persistent_workers=True, prefetch_factor=3,
    )
    dl = prepare_data_loader(original, num_processes=2)
    assert isinstance(dl, DataLoaderShard) and isinstance(dl, DataLoader)
    assert dl.collate_fn is collate and dl.worker_init_fn is init and dl.dataset is original.dataset
    assert (dl.timeout, dl.num_workers, dl.persistent_workers, dl.prefetch_factor) == (7, 2, True, 3)
    rebuilt = prepare_data_loader(DataLoader(Numbers(4), batch_size=2, collate_fn=collate), num_processes=2)
    assert batches(rebuilt) == [[0, 10]]


# ------------------------------------------------------------------------------------------------------
# Device, end of data loader, remainder
# ------------------------------------------------------------------------------------------------------
def test_batches_are_moved_to_the_device():
    loader = DataLoader(Numbers(4), batch_size=2)
    moved = next(iter(prepare_data_loader(loader, device=torch.device("meta"), put_on_device=True)))
    assert moved.device.type == "meta"
    kept = next(iter(prepare_data_loader(loader, device=torch.device("meta"), put_on_device=False)))
    assert kept.device.type == "cpu"
    on_cpu = next(iter(prepare_data_loader(loader, device="cpu")))
    assert on_cpu.device.type == "cpu" and on_cpu.tolist() == [0, 1]


def test_end_of_dataloader_only_on_the_last_batch_and_gradient_state_registration():
    state = GradientState(num_steps=1)  # a new state (GradientState() is the current Accelerator's, if any)
    dl = prepare_data_loader(DataLoader(Numbers(10), batch_size=3), gradient_state=state)
    flags, active = [], []
    for _ in dl:
        flags.append(dl.end_of_dataloader)
        active.append(state.active_dataloader is dl and state.end_of_dataloader == dl.end_of_dataloader)
    assert flags == [False, False, False, True]
    assert all(active)
    assert not dl.end_of_dataloader and state.active_dataloader is None

    for _ in dl:
        break
    assert state.active_dataloader is None and dl.iteration == 1  # a broken epoch does not count


def test_single_batch_loader_is_at_its_end_immediately():
    dl = prepare_data_loader(DataLoader(Numbers(2), batch_size=4))
    assert [dl.end_of_dataloader for _ in dl] == [True]


def gathered_epoch(loaders):
    """What gather_for_metrics would collect: each step's batches in rank order, trimmed at the end."""
    per_rank = [[] for _ in loaders]
    remainders = []
    for r, dl in enumerate(loaders):
        for batch in dl:
            per_rank[r].append(batch.tolist())
            if dl.end_of_dataloader:
                remainders.append(dl.remainder)
            else:
                assert dl.remainder == -1
    out = []
    for step in range(len(per_rank[0])):
        together = flatten(rank[step] for rank in per_rank)
        last = step == len(per_rank[0]) - 1
        out += together[: remainders[0]] if last and remainders[0] > 0 else together
    return out, remainders


@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize(
    "size,batch_size,n,split,expect_padding",
    [(13, 4, 2, False, True), (10, 3, 3, False, True), (8, 4, 2, False, False), (3, 4, 2, False, True),
     (7, 2, 3, False, True), (14, 4, 2, True, True), (16, 4, 2, True, False)],
)
def test_remainder_trims_gathered_batches_to_the_dataset(size, batch_size, n, split, expect_padding, iterable):
    dataset = NumberStream(size) if iterable else Numbers(size)
    loaders = shard_all(DataLoader(dataset, batch_size=batch_size), n, split_batches=split)
    gathered, remainders = gathered_epoch(loaders)
    assert gathered == list(range(size))
    assert len(set(remainders)) == 1 and len(remainders) == n
    # Accelerate's remainder: the real samples of a padded last round, else length % total (0: none), -1 without a
    # length
    assert (remainders[0] > 0) == expect_padding


def test_remainder_with_shuffling_reproduces_the_permutation():
    loaders = shard_all(DataLoader(Numbers(13), batch_size=4, shuffle=True), 2, seed=9)
    gathered, _ = gathered_epoch(loaders)
    assert gathered == torch.randperm(13, generator=torch.Generator().manual_seed(9)).tolist()


# ------------------------------------------------------------------------------------------------------
# Global RNG
# ------------------------------------------------------------------------------------------------------
def _draws(state_after: torch.Tensor, seed: int = 0, most: int = 16):
    """How many int64 draws (torch's DataLoader's seed draws) take manual_seed(seed) to `state_after`."""
    torch.manual_seed(seed)
    for count in range(most):
        if torch.equal(torch.get_rng_state(), state_after):
            return count
        torch.empty((), dtype=torch.int64).random_()
    return None


def _consumption(make, epochs: int = 3) -> list:
    """Global draws counted from manual_seed(0): after `make()` (prepare), then after each of `epochs` passes."""
    torch.manual_seed(0)
    loader = make()
    counts = [_draws(torch.get_rng_state())]
    for _ in range(epochs):
        torch.set_rng_state(_rng_after(counts[-1]))  # _draws moved the RNG: back to where the loop had it
        list(loader)
        counts.append(_draws(torch.get_rng_state()))
    return counts


def _rng_after(count: int) -> torch.Tensor:
    torch.manual_seed(0)
    for _ in range(count):
        torch.empty((), dtype=torch.int64).random_()
    return torch.get_rng_state()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_processes", [1, 2])
def test_prepared_loader_draws_from_the_global_rng_as_accelerate_does(shuffle, num_processes):
    """Accelerate 1.15 (measured): one draw per pass (the workers' base seed); a generator-less shuffle on one
    process draws its seed each epoch as torch's RandomSampler does, on several processes once at prepare (the
    generator it then follows). So the same seed gives Accelerate's dropout masks."""
    def make():
        return prepare_data_loader(DataLoader(Numbers(16), batch_size=2, shuffle=shuffle),
                                   num_processes=num_processes, process_index=num_processes - 1)

    expected = {(False, 1): [0, 1, 2, 3], (True, 1): [0, 2, 4, 6], (False, 2): [0, 1, 2, 3], (True, 2): [1, 2, 3, 4]}
    assert _consumption(make) == expected[shuffle, num_processes]
    torch.manual_seed(0)
    plain = [_draws(torch.get_rng_state())]  # and torch's own loader on one process, as a check of the counter
    loader = DataLoader(Numbers(16), batch_size=2, shuffle=shuffle)
    for _ in range(3):
        list(loader)
        plain.append(_draws(torch.get_rng_state()))
        torch.set_rng_state(_rng_after(plain[-1]))
    assert plain == expected[shuffle, 1]


def test_one_process_shuffle_is_torchs_order():
    torch.manual_seed(7)
    reference = [batches(DataLoader(Numbers(12), batch_size=3, shuffle=True)) for _ in range(2)]
    torch.manual_seed(7)
    prepared = prepare_data_loader(DataLoader(Numbers(12), batch_size=3, shuffle=True), num_processes=1)
    assert [batches(prepared) for _ in range(2)] == reference


@pytest.mark.parametrize("num_processes", [1, 2])
def test_resumed_pass_draws_nothing_and_continues_the_epoch(num_processes):
    """An uninterrupted run vs one resumed mid-epoch from the loader's state and the global RNG state taken at
    the same batch: the same batches and the same global RNG (dropout) afterwards."""
    def make():
        return prepare_data_loader(DataLoader(Numbers(16), batch_size=2, shuffle=True),
                                   num_processes=num_processes, process_index=0)

    torch.manual_seed(3)
    full = make()
    list(full)  # epoch 0
    seen, saved = [], None
    for i, batch in enumerate(full):  # epoch 1, cut after 2 batches
        seen.append(batch.tolist())
        if i == 1:
            saved = (full.state_dict(), torch.get_rng_state())
    after_uninterrupted = torch.rand(3)
    torch.manual_seed(99)  # the resumed process: another start, then the checkpoint's states
    resumed = make()
    resumed.load_state_dict(saved[0])
    torch.set_rng_state(saved[1])
    tail = batches(skip_first_batches(resumed, 2))
    assert tail == seen[2:]
    assert torch.equal(torch.rand(3), after_uninterrupted)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_seeded_loader_never_touches_the_global_rngs_beyond_the_base_seed(num_workers):
    """With a seed (use_seedable_sampler / data_seed) the order needs no global draw: a pass takes only the
    workers' base seed, as torch's loader does, and Python's RNG is never used."""
    loader = DataLoader(Numbers(16), batch_size=2, shuffle=True, num_workers=num_workers)
    dl = prepare_data_loader(loader, num_processes=2, process_index=1, seed=3)
    torch.manual_seed(0)
    python_before = random.getstate()
    first = batches(dl)
    assert _draws(torch.get_rng_state()) == 1
    assert python_before == random.getstate()
    assert first != batches(dl) and len(first) == 4


def test_sampling_with_replacement_is_seeded_too():
    def make():
        sampler = torch.utils.data.RandomSampler(Numbers(10), replacement=True, num_samples=6)
        return prepare_data_loader(DataLoader(Numbers(10), batch_size=2, sampler=sampler), seed=5)

    torch.manual_seed(1)
    first = batches(make())
    torch.manual_seed(2)  # the order depends on the seed alone, not on the global RNG
    assert first == batches(make()) and len(first) == 3


def test_workers_give_the_same_batches_as_the_main_process():
    def make(workers):
        return prepare_data_loader(DataLoader(Numbers(12), batch_size=2, shuffle=True, num_workers=workers), seed=1)

    assert batches(make(2)) == batches(make(0))


# ------------------------------------------------------------------------------------------------------
# Skipping and resuming
# ------------------------------------------------------------------------------------------------------
def test_skip_first_batches_gives_the_tail_of_the_current_epoch_without_loading_the_rest():
    def make():
        dataset = Numbers(20)
        return dataset, prepare_data_loader(DataLoader(dataset, batch_size=2, shuffle=True), num_processes=2, seed=4)

    _, reference = make()
    ref_epochs = [batches(reference) for _ in range(3)]

    dataset, dl = make()
    list(dl)  # epoch 0
    dataset.loaded.clear()
    resumed = skip_first_batches(dl, 3)
    assert isinstance(resumed, DataLoaderShard) and len(resumed) == len(ref_epochs[1]) - 3
    assert batches(resumed) == ref_epochs[1][3:]
    assert sorted(dataset.loaded) == sorted(flatten(ref_epochs[1][3:]))  # skipped batches never loaded
    assert dl.iteration == 2
    assert batches(dl) == ref_epochs[2]


def test_resume_loop_sees_the_same_epochs_as_an_uninterrupted_run():
    def make():
        return prepare_data_loader(DataLoader(Numbers(10), batch_size=2, shuffle=True), seed=2)

    full = make()
    uninterrupted = [batches(full) for _ in range(3)]

    loader = make()
    loader.load_state_dict({"iteration": 1, "seed": 2})
    seen = []
    for epoch in range(1, 3):
        loader_e = skip_first_batches(loader, 2) if epoch == 1 else loader
        seen.append(batches(loader_e))
    assert seen == [uninterrupted[1][2:], uninterrupted[2]]


def test_skip_first_batches_on_iterable_shard_and_end_flags():
    dl = prepare_data_loader(DataLoader(NumberStream(12), batch_size=2), num_processes=2, process_index=1)
    resumed = skip_first_batches(dl, 1)
    flags = []
    out = []
    for b in resumed:
        out.append(b.tolist())
        flags.append(resumed.end_of_dataloader)
    assert out == [[6, 7], [10, 11]] and flags == [False, True] and len(resumed) == 2
    assert dl.iteration == 1


def test_skip_first_batches_on_plain_loaders():
    loader = DataLoader(Numbers(10), batch_size=3)
    skipped = skip_first_batches(loader, 2)
    assert batches(skipped) == [[6, 7, 8], [9]] and len(skipped) == 2
    assert [x.item() for x in skip_first_batches(DataLoader(Numbers(4), batch_size=None), 3)] == [3]
    stream = skip_first_batches(DataLoader(NumberStream(7), batch_size=2), 2)
    assert batches(stream) == [[4, 5], [6]] and len(stream) == 2


def test_state_dict_round_trip():
    def make(seed):
        return prepare_data_loader(DataLoader(Numbers(16), batch_size=4, shuffle=True), seed=seed)

    a = make(11)
    list(a)
    list(a)
    state = a.state_dict()
    assert state == {"iteration": 2, "seed": 11}
    b = make(0)
    b.load_state_dict(state)
    assert b.state_dict() == state
    assert batches(b) == batches(a)


# ------------------------------------------------------------------------------------------------------
# Configuration and arguments
# ------------------------------------------------------------------------------------------------------
def test_dataloader_configuration():
    cfg = DataLoaderConfiguration()
    assert (cfg.split_batches, cfg.dispatch_batches, cfg.even_batches, cfg.non_blocking) == (False, None, True, False)
    assert DataLoaderConfiguration(dispatch_batches=False).dispatch_batches is False
    assert DataLoaderConfiguration(dispatch_batches=True).dispatch_batches is True


def test_stateful_loader_needs_torchdata_and_says_so(monkeypatch):
    import sys

    for name in [n for n in sys.modules if n == "torchdata" or n.startswith("torchdata.")] + ["torchdata"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed (an earlier test may have imported it)
    monkeypatch.delitem(sys.modules, "accel.data.stateful", raising=False)
    with pytest.raises(ImportError, match=r"use_stateful_dataloader=True needs torchdata.*accel-train\[torchdata\]"):
        DataLoaderConfiguration(use_stateful_dataloader=True)


def test_stateful_loader_state_holds_the_position_in_the_epoch():
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = prepare_data_loader(DataLoader(Numbers(10), batch_size=2), use_stateful_dataloader=True)
    assert isinstance(dl, StatefulDataLoader)
    it = iter(dl)
    next(it), next(it)
    state = dl._accel_state_dict()  # what save_state keeps
    assert state["position"]["_num_yielded"] == 2  # the batches handed out, not the one read ahead
    assert dl.state_dict() == state["position"]  # torchdata's own, as Accelerate's adapters return it
    for saved in (state, dl.state_dict()):  # either resumes the epoch
        again = prepare_data_loader(DataLoader(Numbers(10), batch_size=2), use_stateful_dataloader=True)
        again.load_state_dict(saved)
        assert [b.tolist() for b in again] == [[4, 5], [6, 7], [8, 9]]
        assert "position" not in again._accel_state_dict()
    assert again.iteration == 1


def test_process_index_must_be_in_range():
    with pytest.raises(ValueError, match="process_index"):
        prepare_data_loader(DataLoader(Numbers(4), batch_size=2), num_processes=2, process_index=2)


def test_dispatcher_on_one_process_yields_the_original_batches():
    """One process: the dispatcher reads, "broadcasts" to itself and keeps everything; Accelerate's defaults pick it
    for iterable datasets only when batches are put on the device."""
    from accel.data.loading import DataLoaderDispatcher

    stream = NumberStream(10)
    dl = prepare_data_loader(DataLoader(stream, batch_size=4), num_processes=1, process_index=0, put_on_device=True)
    assert isinstance(dl, DataLoaderDispatcher)
    assert [b.tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (len(dl), dl.total_batch_size, dl.batch_size) == (3, 4, 4)
    assert not isinstance(prepare_data_loader(DataLoader(stream, batch_size=4), put_on_device=False),
                          DataLoaderDispatcher)
    with pytest.raises(ValueError, match="dispatch_batches=True needs put_on_device=True"):
        prepare_data_loader(DataLoader(stream, batch_size=4), dispatch_batches=True, put_on_device=False)
    mapped = prepare_data_loader(DataLoader(list(range(6)), batch_size=4), put_on_device=True, dispatch_batches=True)
    assert [b.tolist() for b in mapped] == [[0, 1, 2, 3], [4, 5]]
    assert [b.tolist() for b in skip_first_batches(mapped, 1)] == [[4, 5]]


def test_batch_sampler_given_as_sampler_is_sharded_and_padded_like_a_batch_sampler():
    """DataLoader(sampler=BatchSampler(...), batch_size=None): Accelerate shards the batches themselves, so the last
    round is padded to full batches ([4,4,4] on both ranks for 22 samples), not left short ([4,4,2])."""
    from torch.utils.data import SequentialSampler
    from torch.utils.data.dataloader import default_collate

    class Rows(Dataset):
        def __len__(self):
            return 22

        def __getitem__(self, indices):
            return [torch.tensor(i) for i in indices]

    def loader():
        return DataLoader(Rows(), sampler=BatchSampler(SequentialSampler(range(22)), 4, False), batch_size=None,
                          collate_fn=default_collate)

    got = [[b.tolist() for b in prepare_data_loader(loader(), num_processes=2, process_index=r)] for r in (0, 1)]
    assert got[0] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]
    assert got[1] == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 0, 1]]
    shard = prepare_data_loader(loader(), num_processes=2, process_index=1)
    assert len(shard) == 3 and [b.tolist() for b in skip_first_batches(shard, 2)] == [[20, 21, 0, 1]]


def test_fast_forward_skips_batches_across_epochs_and_counts_them():
    """A fault-tolerant group that healed moves its loader on by the live group's batches: the epoch it is in ends
    early, the next starts later, and batches_handed_out counts the skipped ones as handed out."""
    import torch

    from accel import Accelerator

    loader = Accelerator(cpu=True).prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=2))
    seen = []
    for epoch in range(3):
        got = []
        for index, batch in enumerate(loader):
            got.append(batch.tolist())
            if epoch == 0 and index == 0:
                assert loader.batches_handed_out == 1
                loader.fast_forward(6)  # the 4 left of epoch 0 (the one fetched ahead included) and 2 of epoch 1
        seen.append(got)
    assert seen == [[[0, 1]], [[4, 5], [6, 7], [8, 9]], [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]]
    assert loader.batches_handed_out == 15 and loader.iteration == 3
