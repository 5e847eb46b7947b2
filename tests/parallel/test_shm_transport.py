"""Bundles through shared memory arrive bitwise equal, a dead peer is named in seconds, and the
rings leave nothing behind (no file, no key in the store); pipelined training over shm equals
plain PyTorch."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import pipetorch as poptorch
from parallel_cases import (assert_in_processes, assert_same_result, assert_same_state, cleaned,
                            one_thread_everywhere, options, plain_call, skip_case, twin)
from test_transport_bundles import mixed_tensors, spec_of
from pipetorch.errors import ConfigError, DeviceError
from fault_cases import memory_files, new_shm_entries, shm_entries
from pipetorch.parallel.comm import shm
from pipetorch.parallel.layout.routes import TensorSpec
from pipetorch.parallel.comm.shm import ShmLink
from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, Tag, link_kind

CPU = torch.device("cpu")


@pytest.fixture
def store():
    before = shm_entries()
    store = dist.HashStore()
    yield store
    assert store.num_keys() == 0, "a ring's address outlived its link's set-up"
    assert new_shm_entries(before) == set(), "shared memory left a file in /dev/shm"


def open_links(store, channels, *, timeout=10.0):
    """One ShmLink per rank of `channels` ({rank: [ChannelSpec]}), opened together."""
    links = {rank: ShmLink(store=store, name="test-", rank=rank, device=CPU, wire_device=CPU,
                           timeout=timeout)
             for rank in channels}
    errors = []

    def opening(rank):
        try:
            links[rank].open(channels[rank])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=opening, args=(r,)) for r in channels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return links


def pair(store, layout, tag=Tag.ACTIVATIONS, **kw):
    return open_links(store, {0: [ChannelSpec(1, tag, True, layout.nbytes)],
                               1: [ChannelSpec(0, tag, False, layout.nbytes)]}, **kw)


def assert_bitwise(got, sent):
    assert len(got) == len(sent)
    for g, s in zip(got, sent):
        assert g.dtype == s.dtype and g.shape == s.shape and g.is_contiguous()
        assert torch.equal(g.reshape(-1).view(torch.uint8), s.contiguous().reshape(-1).view(torch.uint8))


def test_every_dtype_and_view_arrives_bitwise_over_more_sends_than_slots(store):
    tensors = mixed_tensors()
    layout = BundleLayout(tuple(spec_of(t) for t in tensors))
    links = pair(store, layout)
    rounds = [[t + n if t.dtype != torch.bool else t ^ bool(n % 2) for t in tensors]
              for n in range(2 * shm.SLOTS + 1)]
    for n, sent in enumerate(rounds):  # the ring fills: later sends wait packed aside
        links[0].send(layout, sent, 1, Tag.ACTIVATIONS)
        if n % 3 == 2:
            assert_bitwise(links[1].recv(layout, 0, Tag.ACTIVATIONS), rounds[n - 2])
            assert_bitwise(links[1].recv(layout, 0, Tag.ACTIVATIONS), rounds[n - 1])
            assert_bitwise(links[1].recv(layout, 0, Tag.ACTIVATIONS), rounds[n])
    for sent in rounds[len(rounds) // 3 * 3:]:
        got = links[1].recv(layout, 0, Tag.ACTIVATIONS)
        assert all(x.data_ptr() % 16 == 0 for x in got if x.numel())  # aligned, viewable
        assert_bitwise(got, sent)
    links[0].flush()
    assert links[0].bytes_sent == links[1].bytes_received == len(rounds) * layout.nbytes
    for link in links.values():
        link.close()


def test_a_sender_changing_its_tensor_after_send_does_not_change_what_arrives(store):
    x = torch.ones(5)
    layout = BundleLayout((spec_of(x),))
    links = pair(store, layout, tag=Tag.GRADIENTS)
    links[0].send(layout, [x], 1, Tag.GRADIENTS)
    x.add_(1)
    got, = links[1].recv(layout, 0, Tag.GRADIENTS)
    got.requires_grad_(True)  # a leaf the receiving stage can differentiate
    assert torch.equal(got.detach(), torch.ones(5)) and got.is_leaf


def test_a_relayed_value_and_its_gradient_cross_two_links_bitwise(store):
    # stage 0 --[a, skip]--> stage 1 --[b, skip]--> stage 2, gradients the same way back, and
    # the done signal from the last stage to stage 0 (sharded inference), over non-neighbours.
    a, skip = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 5).to(torch.bfloat16)
    b = torch.randint(-9, 9, (3,), dtype=torch.int32)
    first, second = BundleLayout((spec_of(a), spec_of(skip))), BundleLayout((spec_of(b), spec_of(skip)))
    A, G, D = Tag.ACTIVATIONS, Tag.GRADIENTS, Tag.DONE
    links = open_links(store, {
        0: [ChannelSpec(1, A, True, first.nbytes), ChannelSpec(1, G, False, first.nbytes),
            ChannelSpec(2, D, False, 0)],
        1: [ChannelSpec(0, A, False, first.nbytes), ChannelSpec(0, G, True, first.nbytes),
            ChannelSpec(2, A, True, second.nbytes), ChannelSpec(2, G, False, second.nbytes)],
        2: [ChannelSpec(1, A, False, second.nbytes), ChannelSpec(1, G, True, second.nbytes),
            ChannelSpec(0, D, True, 0)],
    })
    links[0].send(first, [a, skip], 1, A)
    got_a, got_skip = links[1].recv(first, 0, A)
    links[1].send(second, [b, got_skip], 2, A)
    assert_bitwise(links[2].recv(second, 1, A), [b, skip])
    links[2].send(second, [b * 2, skip * 3], 1, G)
    grad_b, grad_skip = links[1].recv(second, 2, G)
    links[1].send(first, [a * 5, grad_skip], 0, G)
    assert_bitwise(links[0].recv(first, 1, G), [a * 5, skip * 3])
    links[2].signal(0)
    links[0].wait_signal(2)
    for link in links.values():
        link.flush()
        link.close()


def test_shape_mismatch_is_the_same_device_error_as_over_gloo(store):
    layout = BundleLayout((spec_of(torch.zeros(3, 4)),))
    links = pair(store, layout)
    with pytest.raises(DeviceError, match="shape \\[3, 5\\] and dtype torch.float32, but the "
                                          "stages were compiled for \\[3, 4\\]"):
        links[0].send(layout, [torch.zeros(3, 5)], 1, Tag.ACTIVATIONS)


def test_a_receive_with_nothing_coming_times_out_naming_the_stage(store):
    layout = BundleLayout((spec_of(torch.zeros(2)),))
    links = pair(store, layout, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(DeviceError, match="No data from stage 0 within 1s"):
        links[1].recv(layout, 0, Tag.ACTIVATIONS)
    assert time.monotonic() - start < 5


def test_link_kind_follows_the_environment_and_what_shm_can_reach(monkeypatch):
    monkeypatch.delenv("PIPETORCH_TRANSPORT", raising=False)
    assert link_kind([CPU, CPU], one_host=True) == "shm"  # the default on one host's CPUs
    assert link_kind([CPU, CPU], one_host=False) == "gloo"  # across hosts
    assert link_kind([torch.device("cuda", 0), torch.device("cuda", 1)], one_host=True) == "gloo"
    monkeypatch.setenv("PIPETORCH_TRANSPORT", "gloo")
    assert link_kind([CPU, CPU], one_host=True) == "gloo"
    monkeypatch.setenv("PIPETORCH_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match=r"PIPETORCH_TRANSPORT='carrier-pigeon' must be "
                                          r"shm \(.*\) or gloo \("):
        link_kind([CPU, CPU], one_host=True)


_SENDER = textwrap.dedent("""
    import sys, torch
    import torch.distributed as dist
    from pipetorch.parallel.comm.shm import ShmLink
    from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, Tag
    from pipetorch.parallel.layout.routes import TensorSpec
    layout = BundleLayout((TensorSpec((1 << 18,), torch.float32, False),))
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
    link = ShmLink(store=store, name="test-", rank=0, device=torch.device("cpu"),
                   wire_device=torch.device("cpu"), timeout=30)
    link.open([ChannelSpec(1, Tag.ACTIVATIONS, True, layout.nbytes)])
    for n in range(100):  # far more than the ring holds: the sender waits in flush
        link.send(layout, [torch.full((1 << 18,), float(n))], 1, Tag.ACTIVATIONS)
    print("sent", flush=True)
    link.flush()
""")


@pytest.mark.slow
def test_a_peer_killed_mid_send_is_named_within_seconds_and_leaves_nothing():
    layout = BundleLayout((TensorSpec((1 << 18,), torch.float32, False),))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    before = shm_entries()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(store.port)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        link = ShmLink(store=store, name="test-", rank=1, device=CPU, wire_device=CPU, timeout=60)
        link.open([ChannelSpec(0, Tag.ACTIVATIONS, False, layout.nbytes)])
        assert store.num_keys() == 0  # the address was taken back once the sender attached
        first, = link.recv(layout, 0, Tag.ACTIVATIONS)
        assert torch.equal(first, torch.zeros(1 << 18))
        assert sender.stdout.readline().strip() == "sent"  # now waiting in flush, mid-send
        sender.send_signal(signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(DeviceError) as info:
            for n in range(1, 100):
                got, = link.recv(layout, 0, Tag.ACTIVATIONS)
                assert torch.equal(got, torch.full((1 << 18,), float(n)))  # never torn
        assert time.monotonic() - start < 5
        assert f"Stage 0 (pid {sender.pid}) stopped answering" in str(info.value)
        link.close()
        assert new_shm_entries(before) == set()
    finally:
        sender.kill()
        sender.wait(timeout=30)
        sender.stdout.close()


@pytest.mark.slow
def test_pipelined_training_over_shm_equals_plain_pytorch_and_gloo(request, monkeypatch):
    # Three stages with a value relayed over the middle one, trained over shared memory and over
    # gloo: both equal plain PyTorch (and each other bitwise, with one thread everywhere).
    one_thread_everywhere(request, monkeypatch)
    case = skip_case()
    plain = twin(case.model)
    D, G, B = 2, 5, 2
    batches = [case.data(D * G * B, seed=seed) for seed in range(2)]
    results, models = {}, {}
    before = shm_entries()
    for transport in ("shm", "gloo"):
        monkeypatch.setenv("PIPETORCH_TRANSPORT", transport)
        model = twin(case.model)
        opts = options(case, sharded=False, D=D, G=G)
        wrapper = cleaned(request, poptorch.trainingModel(
            model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)))
        results[transport] = [wrapper(*batch) for batch in batches]
        assert_in_processes(wrapper, 3)
        engine = wrapper._compiled.engine
        assert {t.transport for t in engine.last_trace} == {transport}
        assert not [n for n in shm_entries() - before if n.startswith("pipetorch")]  # no file
        wrapper.destroy()
        models[transport] = wrapper.model
        assert new_shm_entries(before) == set()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for call, batch in enumerate(batches):
        expected = plain_call(plain, optimizer, batch, D=D, G=G)
        assert_same_result(results["shm"][call], expected, what=f"call {call} over shm")
        for got, want in zip(results["shm"][call], results["gloo"][call]):
            assert torch.equal(got, want), f"call {call}: shm and gloo differ"
    assert_same_state(models["shm"], plain, what="shm vs plain PyTorch: ")
    assert_same_state(models["shm"], models["gloo"], what="shm vs gloo: ")


def test_host_values_cross_through_an_arena_bitwise_and_grow_by_address():
    # What a worker returns to the host (and the host's inputs): tensors of every dtype inside
    # lists and dicts, with non-tensor leaves; only their places (and a grown file's
    # address) are pickled.
    import gc
    import pickle

    from pipetorch.parallel.comm import arena

    writer, reader = arena.Arena(), arena.Arena()
    try:
        small = {0: [torch.arange(5), "label", None], 3: [torch.randn(2, 2)]}
        big = {n: [t, n] for n, t in enumerate(mixed_tensors())} | {
            99: [torch.randn(1 << 19)]}  # 2 MB: more than the first arena holds
        grown, made = [], set()
        for value in (small, big, small):
            skeleton, packed = arena.pack_tree(writer, value)
            message = pickle.dumps((skeleton, packed))
            assert len(message) < 2000  # places, not bytes
            got = arena.unpack_tree(reader, *pickle.loads(message))
            assert got.keys() == value.keys()
            for key in value:
                for g, v in zip(got[key], value[key]):
                    if isinstance(v, torch.Tensor):
                        assert_bitwise([g], [v])
                    else:
                        assert g == v
            grown.append(packed.grown)
            if packed.grown is not None:  # the file as the kernel names it
                made.add(os.fstat(packed.grown.fd).st_ino)
        first, second, third = grown
        assert first is not None and first.pid == os.getpid() and first.size == 1 << 20
        assert second is not None and second.size >= 1 << 21 and third is None  # then reused
    finally:
        writer.close()
        reader.close()
    gc.collect()
    assert len(made) == 2 and not made & memory_files()  # no descriptor or mapping is left
