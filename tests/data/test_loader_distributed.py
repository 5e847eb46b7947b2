"""Splitting a dataset between processes: contiguous equal shares, shared shuffles, leftovers."""
import pytest
import torch
import torch.distributed as dist
from loader_datasets import IncrementDataset, IncrementIterableDataset, values

import pipetorch as poptorch
import torchrun_loader_seed_job as seed_job
from helpers.torchrun import two_nodes
from pipetorch.data.sampling import DistributedShareSampler, carry_leftovers
from pipetorch.errors import LoaderError
from pipetorch.parallel.comm import rendezvous

Sync, Async = poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async


def loader_for(process_id, processes, *, length=101, shuffle=False, seed=None, mode=Sync,
               drop_last=True, **kwargs):
    opts = poptorch.Options().deviceIterations(2)
    opts.Distributed.configureProcessId(process_id, processes)
    if seed is not None:
        opts.randomSeed(seed)
    return poptorch.DataLoader(opts, IncrementDataset(length), batch_size=2, shuffle=shuffle,
                               mode=mode, drop_last=drop_last, **kwargs)


def items_of(loader):
    return [v for batch in loader for v in values(batch)]


@pytest.mark.parametrize("mode", [Sync, Async])
def test_processes_read_contiguous_equal_shares(mode):
    # 101 items, combined batch 4, 2 processes: 12 steps of 4 = 48 items each.
    shares = []
    for process_id in range(2):
        loader = loader_for(process_id, 2, mode=mode, num_workers=2)
        assert len(loader) == 12
        shares.append(items_of(loader))
        assert items_of(loader) == shares[-1]  # no shuffle: every epoch is the same
        loader.terminate()
    assert shares == [list(range(0, 48)), list(range(48, 96))]


def test_three_processes_without_shuffle():
    shares = [items_of(loader_for(p, 3, length=100)) for p in range(3)]
    assert shares == [list(range(0, 32)), list(range(32, 64)), list(range(64, 96))]


@pytest.mark.parametrize("mode", [Sync, Async])
def test_shuffled_shares_are_disjoint_and_two_epochs_cover_every_item(mode):
    loaders = [loader_for(p, 2, shuffle=True, seed=42, mode=mode) for p in range(2)]
    epochs = [[items_of(loader) for loader in loaders] for _ in range(2)]
    for first, second in epochs:
        assert len(first) == len(second) == 48
        assert not set(first) & set(second)
    assert epochs[0][0] != epochs[1][0]  # a new permutation each epoch
    seen = {item for shares in epochs for share in shares for item in share}
    assert seen == set(range(101))  # the 5 items left over in epoch 1 are read in epoch 2
    for loader in loaders:
        loader.terminate()


def test_every_process_draws_the_same_permutation():
    orders = []
    for process_id in range(3):
        sampler = DistributedShareSampler(50, process_id=process_id, num_processes=3, step=4,
                                          shuffle=True, seed=7, drop_last=True)
        orders.append([sampler.next_epoch_order().tolist() for _ in range(3)])
    assert orders[0] == orders[1] == orders[2]
    assert orders[0][0] != orders[0][1]


def test_leftovers_move_to_the_front_of_the_next_epoch():
    permutation = torch.tensor([5, 3, 9, 0, 1, 7])
    assert carry_leftovers(permutation, torch.tensor([7, 3])).tolist() == [3, 7, 5, 9, 0, 1]
    assert carry_leftovers(permutation, torch.empty(0, dtype=torch.long)).tolist() == \
        permutation.tolist()


def test_drop_last_false_spreads_every_item():
    shares = [items_of(loader_for(p, 2, drop_last=False)) for p in range(2)]
    assert shares == [list(range(0, 51)), list(range(51, 101))]


def test_shuffle_needs_a_random_seed():
    with pytest.raises(ValueError, match=r"shuffle=True with 2 processes .*randomSeed"):
        loader_for(0, 2, shuffle=True)


def test_dataset_smaller_than_one_step_per_process():
    with pytest.raises(ValueError, match=r"has 6 items, fewer than one combined batch \(4\) "
                                         r"for each of the 2 processes"):
        loader_for(0, 2, length=6)


def test_iterable_dataset_needs_manual_partitioning():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(ValueError, match="auto_distributed_partitioning is not supported for "
                                         "an IterableDataset"):
        poptorch.DataLoader(opts, IncrementIterableDataset(10))
    loader = poptorch.DataLoader(opts, IncrementIterableDataset(10),
                                 auto_distributed_partitioning=False)
    assert len(items_of(loader)) == 10


def test_manual_partitioning_reads_everything():
    loader = loader_for(1, 2, auto_distributed_partitioning=False)
    assert items_of(loader) == list(range(100))


@pytest.mark.slow
def test_one_pipelines_processes_shuffle_alike_from_per_rank_seeds(tmp_path):
    # Issue 51: seeded 100 + rank, the processes of one pipeline shuffled their own way,
    # feeding it different batches in every call, with no error.
    results = two_nodes(seed_job.__file__, tmp_path)
    for mode in seed_job.MODES:
        first, second = (result[mode.name] for result in results)
        assert first == second, mode
        assert first[0] != first[1], mode  # reshuffled each epoch
        assert sorted(first[0]) == list(range(40)), mode
    assert results[0]["next_random"] != results[1]["next_random"]  # still seeded per rank


def across(process_id, *, seed=None):
    opts = poptorch.Options().deviceIterations(2)
    opts.Distributed.configureProcessId(process_id, 2).stagesAcrossProcesses(True)
    if seed is not None:
        opts.randomSeed(seed)
    return opts


def test_one_pipelines_processes_shuffle_from_random_seed_without_exchange():
    orders = []
    for process_id in range(2):
        opts = across(process_id, seed=7)
        torch.manual_seed(100 + process_id)
        loader = poptorch.DataLoader(opts, IncrementDataset(40), batch_size=2, shuffle=True)
        orders.append([items_of(loader) for _ in range(2)])
    assert orders[0] == orders[1] and orders[0][0] != orders[0][1]


def test_a_process_waiting_for_process_0s_seed_fails_naming_it(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setitem(rendezvous._stores, ("127.0.0.1", store.port), store)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("PIPETORCH_TIMEOUT", "0.5")
    with pytest.raises(LoaderError, match=r"Process 1 of 2 waited 0.5 s for process 0 to share "
                                          r"the shuffle seed of its DataLoader number \d+"):
        poptorch.DataLoader(across(1), IncrementDataset(40), batch_size=2, shuffle=True)



@pytest.mark.parametrize("mode", [Sync, Async])
def test_one_process_shuffles_from_the_global_rng_as_torch(mode):
    opts = poptorch.Options().deviceIterations(2)
    opts.Distributed.stagesAcrossProcesses(True)  # of one process: nothing to agree on
    torch.manual_seed(5)
    ours = poptorch.DataLoader(opts, IncrementDataset(40), batch_size=2, shuffle=True, mode=mode)
    got = [items_of(ours) for _ in range(2)]
    ours.terminate()
    torch.manual_seed(5)
    torch_loader = torch.utils.data.DataLoader(IncrementDataset(40), batch_size=4, shuffle=True)
    assert got == [items_of(torch_loader) for _ in range(2)]
