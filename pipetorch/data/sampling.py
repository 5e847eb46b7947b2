"""Which indices each host call reads: combined batches, per-process shares, epoch shuffles."""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch.utils.data import Sampler

if TYPE_CHECKING:
    from pipetorch.options import Options

__all__: list[str] = []

# A user's batch_sampler: each item holds the dataset indices of one batch (a torch
# BatchSampler or any iterable of index lists; it may have a len()).
IndexBatches: TypeAlias = "Iterable[Sequence[int]]"


def input_replicas(options: Options) -> int:
    """Replicas that read distinct micro-batches: replicationFactor over input groups.

    `inputReplicaGrouping(size, type)` gives each group of `size` replicas the same data, so
    `options.input_replica_grouping[0]` (R // size, R by default) streams are read per step.
    """
    grouping = getattr(options, "input_replica_grouping", None)
    if grouping is None:
        return options.replication_factor
    return int(grouping[0])


def micro_batches_per_call(options: Options) -> int:
    """Micro-batches one host call consumes: deviceIterations x gradientAccumulation x replicas."""
    return (options.device_iterations * options.Training.gradient_accumulation
            * input_replicas(options))


def combined_batch_size(options: Options, micro_batch: int | None) -> int | None:
    """Samples one host call consumes: B x deviceIterations x gradientAccumulation x replicas."""
    if micro_batch is None:
        return None
    return micro_batch * micro_batches_per_call(options)


def length_of(values: object) -> int:
    """len(values), with len()'s TypeError for an iterable that has no length."""
    if not isinstance(values, Sized):
        raise TypeError(f"object of type '{type(values).__name__}' has no len()")
    return len(values)


def _share_lengths(num_items: int, step: int, processes: int, drop_last: bool) -> list[int]:
    if drop_last:
        per_process = step * (num_items // (step * processes))
        if per_process == 0:
            raise ValueError(
                f"The dataset has {num_items} items, fewer than one combined batch ({step}) "
                f"for each of the {processes} processes ({step * processes} items): use a "
                "smaller batch_size / deviceIterations, or drop_last=False.")
        return [per_process] * processes
    # drop_last=False: spread every item, the first processes take one more (PopTorch does so).
    return [num_items // processes + (p < num_items % processes) for p in range(processes)]


class DistributedShareSampler(Sampler[int]):
    """This process's contiguous share of each epoch's order, as long as every other share.

    Without shuffling the order is 0..N-1 every epoch (the tail that does not fill a step in
    every process is skipped, as torch's drop_last skips it). With shuffling every process
    draws the same permutation from `seed`, advancing one permutation per epoch, and the
    items an epoch left over are put first in the next epoch's order so they get used.
    """

    def __init__(self, num_items: int, *, process_id: int, num_processes: int, step: int,
                 shuffle: bool, seed: int | None, drop_last: bool) -> None:
        if shuffle and seed is None:
            raise ValueError(
                f"shuffle=True with {num_processes} processes needs the same permutation in "
                "every process: call options.randomSeed(N) with the same N in every process.")
        lengths = _share_lengths(num_items, step, num_processes, drop_last)
        self.num_items = num_items
        self.start = sum(lengths[:process_id])
        self.length = lengths[process_id]
        self.used = sum(lengths)
        self.shuffle = shuffle
        self._generator_state = _seeded_state(seed) if shuffle and seed is not None else None
        self._leftovers = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        order = self.next_epoch_order()
        return iter(order[self.start:self.start + self.length].tolist())

    def next_epoch_order(self) -> torch.Tensor:
        """The global order of the next epoch (the same in every process)."""
        if not self.shuffle or self._generator_state is None:
            return torch.arange(self.num_items)
        generator = torch.Generator()
        generator.set_state(self._generator_state)
        permutation = torch.randperm(self.num_items, generator=generator)
        self._generator_state = generator.get_state()
        order = carry_leftovers(permutation, self._leftovers)
        self._leftovers = order[self.used:].clone()
        return order


def _seeded_state(seed: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return generator.get_state()


def carry_leftovers(permutation: torch.Tensor, leftovers: torch.Tensor) -> torch.Tensor:
    """Move last epoch's unused items to the front, in the order the new permutation has them."""
    if leftovers.numel() == 0:
        return permutation
    is_leftover = torch.isin(permutation, leftovers)
    return torch.cat([permutation[is_leftover], permutation[~is_leftover]])


class CombinedBatchSampler(Sampler[list[list[int]]]):
    """Groups `count` consecutive batches of a user's batch_sampler into one host call.

    Each group is the list of the sampler's own index lists, so every batch is collated as
    the sampler made it (see fetch.CollatedGroups). The epoch has len(batch_sampler) // count
    groups; with drop_last=False a last, shorter group holds the remaining batches. A batch's
    number of indices does not matter: a collate_fn may pad it to any size.
    """

    def __init__(self, batch_sampler: IndexBatches, *, count: int, drop_last: bool) -> None:
        self.batch_sampler = batch_sampler
        self.count = count
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[list[int]]]:
        group: list[list[int]] = []
        for indices in self.batch_sampler:
            group.append(list(indices))
            if len(group) == self.count:
                yield group
                group = []
        if group and not self.drop_last:
            yield group

    def __len__(self) -> int:
        batches = length_of(self.batch_sampler)
        if self.drop_last:
            return batches // self.count
        return math.ceil(batches / self.count)


def rebatched_length(num_items: int, combined: int, *, drop_last: bool) -> int:
    """Host calls in an epoch when the loader repacks worker batches to the combined size."""
    if drop_last:
        return num_items // combined
    return math.ceil(num_items / combined)
