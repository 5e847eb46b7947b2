"""Messages with tensors over a pipe, storage by storage (parallel/comm/stream.py)."""
from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch
from safetensors.torch import save_file

from pipetorch.parallel.comm import stream
from pipetorch.weights import mapped


def pipe() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def round_trip(message):
    sender, receiver = pipe()
    thread = threading.Thread(target=stream.send, args=(sender, message))
    thread.start()
    got, nbytes = stream.receive(receiver, timeout=10)
    thread.join()
    return got, nbytes


def test_tensors_views_parameters_and_modules_arrive_equal_and_share_as_they_did():
    base = torch.randn(10, 10)
    linear = torch.nn.Linear(300, 200)
    message = {"base": base, "view": base[2:5], "linear": linear, "half": torch.randn(7).half(),
               "empty": torch.empty(0), "meta": torch.empty(3, device="meta"),
               "param": torch.nn.Parameter(torch.ones(2)), "big": torch.randn(5_000_000)}
    got, nbytes = round_trip(message)
    for key in ("base", "view", "half", "empty", "big"):
        assert torch.equal(got[key], message[key]), key
    assert torch.equal(got["linear"].weight, linear.weight)
    # the view and its base still share one storage: tied weights stay tied
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert got["meta"].device.type == "meta" and got["meta"].shape == (3,)
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    # each storage travels once (the view's bytes are the base's)
    payload = sum(t.untyped_storage().nbytes() for t in (base, linear.weight, linear.bias,
                                                        message["half"], message["param"],
                                                        message["big"]))
    assert payload <= nbytes < payload + 10_000


# A message of importable objects goes through the C pickler; one with user code (a lambda
# here, a class of the user's __main__ in a script) through cloudpickle's. Both rebuild alike.
@pytest.mark.parametrize("user_code", [False, True], ids=["C pickler", "cloudpickle"])
def test_both_picklers_rebuild_strides_offsets_dtypes_gradients_and_shared_storages(user_code):
    base = torch.arange(24.).reshape(4, 6)
    message = {"strided": base[1:, ::2], "transposed": base.t(), "storage": base.untyped_storage(),
               "grad": torch.ones(3, requires_grad=True), "int": torch.arange(5),
               "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
               "complex": torch.randn(3, dtype=torch.complex64)}
    if user_code:
        message["code"] = lambda x: x + 1
    else:  # what the C pickler leaves to torch's own reduction: still rebuilt alike
        message["attribute"] = torch.ones(2)
        message["attribute"].label = "kept"
        message["conjugate"] = torch.randn(2, dtype=torch.complex64).conj()
    header, storages = stream.pack(message)
    assert (b"_stored" in header) is not user_code  # the C pickler reduces tensors to it
    assert len(storages) == (6 if user_code else 8)  # base's once, for its views and itself
    got, _ = round_trip(message)
    for key in ("strided", "transposed", "int", "bool", "scalar", "complex"):
        assert torch.equal(got[key], message[key]), key
        assert got[key].stride() == message[key].stride(), key
    shared = {got[key].untyped_storage().data_ptr() for key in ("strided", "transposed")}
    assert shared == {got["storage"].data_ptr()}
    assert got["grad"].requires_grad and got["grad"].is_leaf
    if not user_code:
        assert got["attribute"].label == "kept"
        assert got["conjugate"].is_conj() and torch.equal(got["conjugate"], message["conjugate"])
    assert not user_code or got["code"](1) == 2


def test_a_storage_larger_than_a_chunk_is_read_in_chunks_into_place():
    big = torch.arange(stream.CHUNK // 4 * 2 + 3, dtype=torch.int32)  # 2 chunks and a bit
    got, _ = round_trip([big])
    assert torch.equal(got[0], big)


def test_silence_raises_timeout_and_a_sender_gone_mid_message_raises_eof():
    sender, receiver = pipe()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        stream.receive(receiver, timeout=0.5)
    assert time.monotonic() - start < 5
    # a skeleton announcing a storage whose bytes never come, then the sender closes
    import pickle
    header = pickle.dumps(([1000], pickle.dumps("x")))
    sender.send_bytes(stream._INLINE.pack(len(header), 0) + header)  # not inline: chunks follow
    sender.close()
    with pytest.raises(EOFError):
        stream.receive(receiver, timeout=5)


def test_a_mapped_tensor_travels_as_its_file_region(tmp_path):
    path = str(tmp_path / "w.safetensors")
    weights = {"a": torch.randn(1000, 100), "b": torch.randn(3)}
    save_file(weights, path)
    source = mapped.SafetensorsFile(path)
    a = source.tensor("a")
    assert mapped.region_of(a.untyped_storage()) is not None
    got, nbytes = round_trip({"a": a, "plain": torch.ones(4)})
    assert torch.equal(got["a"], weights["a"])
    assert nbytes < 10_000  # the 400 KB of `a` were read by the receiver from the file
    assert mapped.region_of(got["a"].untyped_storage()) is None  # its own memory now
    got["a"].add_(1)  # and writable
    assert torch.equal(source.tensor("a"), weights["a"])  # the file never changes


def test_bytes_for_another_machine_carry_a_mapped_tensors_own_bytes(tmp_path):
    """stream.dumps (the rounds between host processes, which may be on other machines): a
    mapped storage goes as its bytes, not as a path on this machine; views stay views."""
    path = str(tmp_path / "w.safetensors")
    weights = {"a": torch.randn(1000, 100)}
    save_file(weights, path)
    a = mapped.SafetensorsFile(path).tensor("a")
    base = torch.arange(10.0)
    data = stream.dumps({"a": a, "view": base[2:5], "base": base, "n": 3})
    assert len(data) > a.numel() * 4
    os.remove(path)  # the receiver reads nothing of the file
    got = stream.loads(data)
    assert torch.equal(got["a"], weights["a"]) and got["n"] == 3
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert torch.equal(got["view"], torch.tensor([2.0, 3.0, 4.0]))


def _explode() -> None:
    raise LookupError("no such class here")


class _Unbuildable:
    """Pickles fine; rebuilding it raises, as a class the receiver cannot import does."""

    def __reduce__(self):
        return (_explode, ())


@pytest.mark.parametrize("size", [4, 2 * stream.INLINE // 4], ids=["one write", "chunks"])
def test_small_messages_are_one_write_and_an_unbuildable_one_leaves_the_pipe_clean(size):
    small = {"ids": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3), "pos": torch.arange(3)}
    assert len(stream.encode(small).frames) == 1  # three tensors, one pipe message
    big = torch.randn(2 * stream.INLINE // 4)  # 2 INLINE bytes: header, then its chunks
    assert len(stream.encode(big).frames) == 2
    sender, receiver = pipe()
    values = torch.randn(size)
    thread = threading.Thread(target=lambda: [stream.send(sender, m) for m in (
        [_Unbuildable(), values], small)])
    thread.start()
    with pytest.raises(stream.Undeliverable, match="LookupError: no such class here"):
        stream.receive(receiver, timeout=10)
    got, _ = stream.receive(receiver, timeout=10)  # the next message arrives whole
    thread.join()
    assert got.keys() == small.keys() and all(torch.equal(got[k], small[k]) for k in small)
