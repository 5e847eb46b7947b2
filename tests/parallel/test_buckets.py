"""Replica all-reduces go bucket by bucket: at most one bucket of extra memory, same sums."""
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pipetorch.parallel.comm.buckets import buckets
from pipetorch.parallel.comm.transport import PeerLink

CPU = torch.device("cpu")


def shapes(found):
    return [[(p.tensor.dtype, p.start, p.stop) for p in bucket] for bucket in found]


def test_tensors_fill_buckets_in_order_and_a_large_one_is_sliced():
    a, b, c = torch.zeros(10), torch.zeros(40), torch.zeros(5)
    f32 = torch.float32
    assert shapes(buckets([a, b, c], limit=25 * 4)) == [
        [(f32, 0, 10), (f32, 0, 15)], [(f32, 15, 40)], [(f32, 0, 5)]]


def test_each_bucket_holds_one_dtype():
    found = buckets([torch.zeros(3), torch.zeros(3, dtype=torch.float16), torch.zeros(2)],
                    limit=1000)
    assert [{p.tensor.dtype for p in bucket} for bucket in found] == [
        {torch.float32}, {torch.float16}]
    assert [sum(p.numel for p in bucket) for bucket in found] == [5, 3]


def test_a_non_contiguous_tensor_is_never_sliced():
    wide = torch.zeros(4, 8).t()  # 32 elements, not contiguous
    found = buckets([torch.zeros(3), wide, torch.zeros(2)], limit=10 * 4)
    assert shapes(found) == [[(torch.float32, 0, 3)], [(torch.float32, 0, 32)],
                             [(torch.float32, 0, 2)]]


def test_a_limit_below_one_byte_is_refused_with_the_value():
    with pytest.raises(ValueError, match="limit=0"):
        buckets([torch.zeros(1)], limit=0)


class Doubling:
    """dist.all_reduce as two identical replicas would sum: x + x; records each message's
    bytes."""

    def __init__(self):
        self.sizes, self.storages = [], []

    def __call__(self, flat, group=None, async_op=False):
        self.sizes.append(flat.numel() * flat.element_size())
        self.storages.append((flat.dtype, flat.untyped_storage().data_ptr()))
        flat.add_(flat.clone())
        return mock.Mock(wait=mock.Mock(return_value=True))


def test_all_reduce_sums_every_tensor_one_bucket_at_a_time():
    torch.manual_seed(0)
    grads = [torch.randn(7, 5), torch.randn(300), torch.randn(4, 4).t(),
             torch.randn(33, dtype=torch.float64), torch.randn(2, 3).half()]
    want = [g + g for g in grads]
    link = PeerLink(device=CPU, wire_device=CPU, timeout=1)
    link.bucket_bytes = 64 * 4
    reduce = Doubling()
    with mock.patch.object(dist, "all_reduce", reduce):
        link.all_reduce(grads)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert max(reduce.sizes) <= 64 * 4  # the extra memory: one bucket, not every gradient
    own = {t.untyped_storage().data_ptr() for t in grads}
    copied = {(dtype, at) for dtype, at in reduce.storages if at not in own}
    assert len(copied) == len({dtype for dtype, _ in copied})  # one buffer per dtype, reused
    assert len(reduce.storages) > len(copied)  # and a lone slice is reduced where it lies
    assert sum(reduce.sizes) == sum(g.numel() * g.element_size() for g in grads)
    assert link.bytes_sent == link.bytes_received == sum(reduce.sizes)
