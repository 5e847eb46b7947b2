"""BundleLayout packs a bundle's tensors into one aligned byte buffer; backend_for picks the backend."""
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pipetorch.errors import DeviceError
from pipetorch.parallel.layout.routes import TensorSpec
from pipetorch.parallel.comm.transport import BundleLayout, PeerLink, Tag, backend_for

CPU = torch.device("cpu")


def spec_of(tensor, requires_grad=False):
    return TensorSpec(tuple(tensor.shape), tensor.dtype, requires_grad)


def mixed_tensors():
    """Every dtype a bundle carries, odd byte sizes, a 0-dim and an empty tensor, and views."""
    torch.manual_seed(0)
    base = torch.randn(4, 6, dtype=torch.float64)
    return [
        torch.randn(3, 5),                                   # float32, 60 bytes
        base.t(),                                            # float64, transposed (non-contiguous)
        torch.arange(-7, 6, dtype=torch.int64)[::2],         # int64, strided slice
        torch.tensor([True, False, True]),                   # bool, 3 bytes
        torch.randn(2, 3).to(torch.float16)[:, 1:],          # float16, non-contiguous
        torch.tensor(3.25, dtype=torch.bfloat16),            # 0-dim
        torch.empty(0, 4),                                   # empty
        torch.randn(7).to(torch.bfloat16),                   # bfloat16, 14 bytes
        torch.tensor(-2**40, dtype=torch.int64),             # 0-dim int64 needing all 8 bytes
        torch.randn(1, 1, 3).expand(2, 4, 3),                # stride-0 (expanded) view
    ]


def test_pack_unpack_round_trips_every_dtype_exactly():
    tensors = mixed_tensors()
    layout = BundleLayout(tuple(spec_of(t) for t in tensors))
    buffer = layout.pack(tensors, CPU)
    assert buffer.dtype == torch.uint8 and buffer.shape == (layout.nbytes,)
    unpacked = layout.unpack(buffer)
    assert len(unpacked) == len(tensors)
    for sent, got in zip(tensors, unpacked):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.is_contiguous()
        # bitwise equality: compare the raw bytes, not values (no NaN or rounding excuses)
        assert torch.equal(got.reshape(-1).view(torch.uint8),
                           sent.contiguous().reshape(-1).view(torch.uint8))


def test_offsets_are_16_byte_aligned_and_nbytes_adds_padded_sizes():
    tensors = mixed_tensors()
    layout = BundleLayout(tuple(spec_of(t) for t in tensors))
    sizes = [t.numel() * t.element_size() for t in tensors]
    assert sizes == [60, 192, 56, 3, 8, 2, 0, 14, 8, 96]
    assert layout.offsets == [0, 64, 256, 320, 336, 352, 368, 368, 384, 400]
    assert all(at % 16 == 0 for at in layout.offsets)
    assert layout.nbytes == 496
    assert [s.nbytes for s in layout.specs] == sizes


def test_empty_layout_has_no_bytes():
    layout = BundleLayout(())
    assert layout.offsets == [] and layout.nbytes == 0
    assert layout.pack([], CPU).numel() == 0 and layout.unpack(torch.empty(0, dtype=torch.uint8)) == []


def test_unpacked_tensors_are_leaves_that_can_require_grad():
    tensors = [torch.randn(2, 3, requires_grad=True) * 2, torch.arange(4)]
    layout = BundleLayout((spec_of(tensors[0], True), spec_of(tensors[1])))
    floats, ints = layout.unpack(layout.pack(tensors, CPU))
    assert floats.is_leaf and floats.grad_fn is None and not floats.requires_grad
    assert ints.is_leaf and not ints.requires_grad
    floats.requires_grad_(True)
    (floats * torch.arange(6.0).view(2, 3)).sum().backward()
    assert torch.equal(floats.grad, torch.arange(6.0).view(2, 3))
    assert torch.equal(floats.detach(), tensors[0].detach())


def test_pack_does_not_keep_a_link_to_the_inputs():
    x = torch.ones(4)
    layout = BundleLayout((spec_of(x),))
    buffer = layout.pack([x], CPU)
    x.add_(1)  # the sender may reuse its tensor once packed
    assert torch.equal(layout.unpack(buffer)[0], torch.ones(4))


@pytest.mark.parametrize("tensor, wanted", [
    (torch.zeros(3, 5), "shape [3, 5] and dtype torch.float32, but the stages were compiled "
                        "for [3, 4] torch.float32"),
    (torch.zeros(3, 4, dtype=torch.float64), "shape [3, 4] and dtype torch.float64, but the "
                                             "stages were compiled for [3, 4] torch.float32"),
    (torch.zeros(12), "shape [12] and dtype torch.float32, but the stages were compiled for "
                      "[3, 4] torch.float32"),
])
def test_shape_or_dtype_mismatch_is_a_device_error_naming_both(tensor, wanted):
    layout = BundleLayout((TensorSpec((2,), torch.int64, False),
                           TensorSpec((3, 4), torch.float32, True)))
    with pytest.raises(DeviceError) as info:
        layout.pack([torch.zeros(2, dtype=torch.int64), tensor], CPU)
    assert wanted in str(info.value)
    assert "no shape that depends on the data" in str(info.value)


def test_peer_link_skips_empty_bundles_without_touching_torch_distributed():
    link = PeerLink(device=CPU, wire_device=CPU, timeout=1)
    refuse = mock.Mock(side_effect=AssertionError("an empty bundle must not be transferred"))
    with mock.patch.object(dist, "isend", refuse), mock.patch.object(dist, "irecv", refuse):
        link.send(BundleLayout(()), [], 1, Tag.ACTIVATIONS)
        assert link.recv(BundleLayout(()), 1, Tag.GRADIENTS) == []
        link.flush()
    assert refuse.call_count == 0
    assert link.bytes_sent == link.bytes_received == 0
    assert len({int(t) for t in Tag}) == len(Tag)  # tags never mix two kinds of traffic


def cuda(*indices):
    return [torch.device("cuda", i) if i is not None else torch.device("cuda") for i in indices]


def test_backend_for_cpu_stages_is_gloo_without_staging():
    assert backend_for([CPU]) == ("gloo", False)
    assert backend_for([CPU, CPU, CPU]) == ("gloo", False)


@pytest.mark.parametrize("nccl", [True, False])
def test_backend_for_gpus(nccl):
    with mock.patch.object(dist, "is_nccl_available", return_value=nccl):
        # one GPU per stage: NCCL straight between GPUs when it is there
        assert backend_for(cuda(0, 1, 2)) == (("nccl", False) if nccl else ("gloo", True))
        assert backend_for(cuda(0)) == (("nccl", False) if nccl else ("gloo", True))
        # two stages on one GPU: NCCL refuses, so gloo through host memory
        assert backend_for(cuda(0, 1, 0)) == ("gloo", True)
        assert backend_for(cuda(None, None)) == ("gloo", True)
