"""Issue 22, data: a batch_sampler in every loader mode trained against plain PyTorch, a
dataset that raises, and Ctrl-C while an AsynchronousDataAccessor is loading."""
import copy
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import BatchSampler, RandomSampler, TensorDataset

import pipetorch as poptorch
from helpers.models import TinyMLP, data

D, B = 2, 3


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async,
                                  poptorch.DataLoaderMode.AsyncRebatched])
def test_a_batch_sampler_trains_like_plain_pytorch_over_its_batches(mode):
    x, labels = data(30)
    dataset = TensorDataset(x, labels)
    sampler = BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(3)),
                           batch_size=B, drop_last=True)
    plain_batches = list(torch.utils.data.DataLoader(dataset, batch_sampler=sampler))
    sampler.sampler.generator.manual_seed(3)  # the same permutation for pipetorch's epoch
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    loader = poptorch.DataLoader(opts, dataset, batch_sampler=sampler, mode=mode)
    assert len(loader) == len(plain_batches) // D
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    wrapper = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    calls = 0
    for call, (bx, blabels) in enumerate(loader):
        want = []
        for px, plabels in plain_batches[call * D:(call + 1) * D]:
            optimizer.zero_grad()
            loss = plain(px, plabels)[1]
            loss.backward()
            optimizer.step()
            want.append(loss.detach())
        assert_close(bx, torch.cat([b[0] for b in plain_batches[call * D:(call + 1) * D]]))
        assert_close(wrapper(bx, blabels)[1].as_subclass(torch.Tensor), torch.stack(want))
        calls += 1
    assert calls == len(plain_batches) // D
    loader.terminate()
    wrapper.destroy()
    assert_close(model.fc2.weight, plain.fc2.weight)


class Raises(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, index):
        if index == 7:
            raise ValueError(f"corrupt record {index}")
        return torch.tensor([float(index)])


def test_a_dataset_that_raises_in_sync_mode_raises_its_own_error():
    # Sync mode is torch's DataLoader in this process: the dataset's exception as it is.
    loader = poptorch.DataLoader(poptorch.Options(), Raises(), batch_size=2)
    with pytest.raises(ValueError, match="corrupt record 7"):
        list(loader)


def test_a_dataset_that_raises_in_async_mode_reports_its_type_message_and_line():
    loader = poptorch.DataLoader(poptorch.Options(), Raises(), batch_size=2,
                                 mode=poptorch.DataLoaderMode.Async)
    with pytest.raises(poptorch.Error, match="An error occurred in the data fetcher: .*"
                                             "ValueError: corrupt record 7") as info:
        list(loader)
    assert isinstance(info.value, RuntimeError)
    assert 'raise ValueError(f"corrupt record {index}")' in str(info.value)  # loader traceback
    loader.terminate()


class RaisesFirst(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        raise KeyError(f"no record {index}")


@pytest.mark.parametrize("make", ["DataLoader", "AsynchronousDataAccessor"])
def test_a_dataset_failing_its_first_batch_fails_when_the_accessor_starts(make):
    # PopTorch's accessor waits for its worker's first batch when it is made: a dataset that
    # cannot produce it is reported there ("worker thread failed to start"), not at next().
    sync = poptorch.DataLoader(poptorch.Options(), RaisesFirst(), batch_size=2)
    with pytest.raises(poptorch.Error, match="(?s)worker thread failed to start.*"
                                             "KeyError: 'no record 0'") as info:
        if make == "DataLoader":
            poptorch.DataLoader(poptorch.Options(), RaisesFirst(), batch_size=2,
                                mode=poptorch.DataLoaderMode.Async)
        else:
            poptorch.AsynchronousDataAccessor(sync)
    assert isinstance(info.value.__cause__, KeyError)


_INTERRUPTED = textwrap.dedent("""
    import faulthandler, signal, time, torch
    import pipetorch as poptorch

    faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if stuck
    # Ctrl-C as in a terminal: a test runner (or a shell's background job) may pass SIGINT on
    # ignored or blocked, and both survive exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, index):
            time.sleep(0.01)
            return torch.tensor([float(index)])

    if __name__ == "__main__":
        loader = poptorch.DataLoader(poptorch.Options(), Slow(), batch_size=2)
        accessor = poptorch.AsynchronousDataAccessor(loader)
        for index, batch in enumerate(accessor):
            if index == 0:
                print("loading", flush=True)
""")


@pytest.mark.slow
def test_ctrl_c_while_an_accessor_is_loading_stops_the_script_and_its_loader(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "loading"
        loaders = subprocess.run(["pgrep", "-P", str(child.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert loaders, "the accessor runs its loader in a process"
        child.send_signal(signal.SIGINT)
        try:
            _, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)
            time.sleep(2)
            child.kill()
            _, err = child.communicate(timeout=30)
            pytest.fail(f"the script ignored Ctrl-C; its stacks and stderr:\n{err[-6000:]}")
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert "Traceback" in err and "LoaderError" not in err
    for pid in loaders:  # the loader process went with it
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
