"""A failing, killed or interrupted stage worker ends the user's call with a clear error, fast.

Each test runs a two-stage model in worker processes (ipu 0 and ipu 1), breaks one worker,
and checks the error the user sees (stage, device, micro-batch and where it sits in the call,
the worker's traceback), that it comes in seconds rather than a hang, that no worker is left,
and that a new wrapper of the same model works afterwards.
"""
import copy
import os
import signal
import threading
import time

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from fault_cases import registry  # noqa: F401 - the fixture
from fault_cases import (CLASSES, LONG_D, LONG_DEPTH, VOCAB, HeavyNet, Script, TokenNet, alive,
                         heavy_data, options, records_of, token_data, wait_busy, wait_gone)
from helpers.reference import expected_outputs, plain_train_call
from pipetorch.errors import DeviceError
from pipetorch.parallel.comm.wire import WorkerFailed

pytestmark = pytest.mark.slow

NO_HANG = 30.0  # seconds: generous on a loaded machine; a hang would hit PIPETORCH_TIMEOUT (60)


@pytest.fixture
def wrappers():
    """Wrappers made by a test; destroyed at teardown even when the test fails."""
    made = []
    yield made
    for wrapper in made:
        wrapper.destroy()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_loss_error_in_a_late_micro_batch_names_where_and_a_new_wrapper_trains(registry, wrappers):
    torch.manual_seed(0)
    model = TokenNet()
    D, G, R, B = 2, 4, 2, 2
    opts = options(D=D, G=G, R=R)
    wrapper = poptorch.trainingModel(model, opts, optimizer=_sgd(model))
    wrappers.append(wrapper)
    tokens, labels = token_data(D * G * R * B)
    out, loss = wrapper(tokens, labels)
    assert out.shape == (D * G * R * B, CLASSES) and torch.isfinite(loss).all()
    engine = wrapper._compiled.engine
    pids = list(engine.worker_pids)
    assert len(pids) == 2 * R and all(alive(p) for p in pids)  # stage s of replica r: r * 2 + s
    assert sorted(r["pid"] for r in records_of(os.getpid())) == sorted(pids)

    # micro-batch 11 = device iteration 1, accumulation step 1, replica 1 ([D][G][R] order);
    # the compile-time probe only saw micro-batch 0, so only the worker can notice.
    bad = labels.clone()
    bad[11 * B + 1] = CLASSES + 4
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        wrapper(tokens, bad)
    assert time.monotonic() - start < NO_HANG
    message = str(info.value)
    assert isinstance(info.value, DeviceError)
    assert message.startswith(
        f"Stage 1 of replica 1 on cpu (pid {pids[3]}) failed in the forward of micro-batch 11 (device "
        f"iteration 1, accumulation step 1, replica 1): IndexError: Target {CLASSES + 4} is out "
        "of bounds."), message
    head, traceback = message.split("\n\nWorker traceback:\n", 1)
    assert traceback.startswith("Traceback (most recent call last):")
    assert "cross_entropy" in traceback and "pipetorch/parallel/worker/stage.py" in traceback
    assert traceback.rstrip().endswith(f"IndexError: Target {CLASSES + 4} is out of bounds.")
    failure = info.value.failure
    # the worker counts its own replica's micro-batches: 11 is replica 1's fifth (1 * G + 1)
    assert (failure.stage, failure.replica, failure.device, failure.pid, failure.action,
            failure.micro_batch) == (1, 1, "cpu", pids[3], "F", 5)

    assert wait_gone(pids) == []  # the failing worker and its healthy neighbour
    assert records_of(os.getpid()) == []
    start = time.monotonic()
    with pytest.raises(DeviceError, match=r"call destroy\(\) and build a new trainingModel"):
        wrapper(tokens, labels)
    assert time.monotonic() - start < 5.0
    wrapper.destroy()
    assert engine.worker_pids == [] and not wrapper.isCompiled()

    # The same model trains in a new wrapper exactly like plain PyTorch.
    reference = copy.deepcopy(model)
    ref_opt = _sgd(reference)
    again = poptorch.trainingModel(model, opts, optimizer=_sgd(model))
    wrappers.append(again)
    out, loss = again(tokens, labels)
    rows = plain_train_call(reference, ref_opt, tokens, labels, D=D, G=G, R=R)
    want_out, want_loss = expected_outputs(rows, "All", steps=D * G, R=R)
    assert_close(out, want_out)
    assert_close(loss, want_loss)
    for name, param in reference.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)


def test_forward_error_on_the_first_stage_names_it(registry, wrappers):
    torch.manual_seed(0)
    model = TokenNet()
    D, B = 4, 2
    wrapper = poptorch.inferenceModel(model, options(D=D, G=1))  # fill-drain over 4 micro-batches
    wrappers.append(wrapper)
    tokens, labels = token_data(D * B)
    wrapper(tokens, labels)
    pids = list(wrapper._compiled.engine.worker_pids)
    bad = tokens.clone()
    bad[2 * B, 3] = VOCAB + 5  # micro-batch 2 reads a token the embedding does not have
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        wrapper(bad, labels)
    assert time.monotonic() - start < NO_HANG
    message = str(info.value)
    assert message.startswith(
        f"Stage 0 on cpu (pid {pids[0]}) failed in the forward of micro-batch 2 (device "
        "iteration 2, accumulation step 0, replica 0): IndexError: index out of range"), message
    traceback = message.split("\n\nWorker traceback:\n", 1)[1]
    assert "embedding" in traceback and "IndexError: index out of range" in traceback
    assert (info.value.failure.stage, info.value.failure.micro_batch) == (0, 2)
    assert wait_gone(pids) == []  # stage 1, waiting for micro-batch 2's activations, too
    assert records_of(os.getpid()) == []
    with pytest.raises(DeviceError, match="The stage workers were lost"):
        wrapper(tokens, labels)


def test_worker_killed_during_a_call_fails_the_call_fast(registry, wrappers):
    torch.manual_seed(0)
    model = HeavyNet(depth=LONG_DEPTH)
    wrapper = poptorch.trainingModel(model, options(D=LONG_D, G=4), optimizer=_sgd(model))
    wrappers.append(wrapper)
    x, y = heavy_data(LONG_D * 4 * 32)
    wrapper.compile(x, y)
    pids = list(wrapper._compiled.engine.worker_pids)
    result = {}

    def call():
        try:
            wrapper(x, y)
            result["returned"] = True
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            result["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    wait_busy(pids[1])  # the last stage computes: the call is under way
    assert thread.is_alive(), "the call ended before the worker could be killed"
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(10.0)
    assert not thread.is_alive(), "the call still runs 10 s after its worker was killed"
    assert time.monotonic() - killed < 10.0
    error = result.get("error")
    assert isinstance(error, DeviceError), result
    assert str(error).startswith(
        f"The worker running stage 1 on cpu (pid {pids[1]}) died during a training call (exit "
        "code -9, killed by SIGKILL)"), str(error)
    assert wait_gone(pids) == []
    assert records_of(os.getpid()) == []
    wrapper.destroy()

    # A new wrapper (here for inference) of the same model runs in this process...
    D, B = 2, 8
    x, y = heavy_data(D * B, seed=1)
    infer = poptorch.inferenceModel(model, options(D=D, G=1))
    wrappers.append(infer)
    out, _ = infer(x, y)
    with torch.no_grad():
        want, _ = model(x, y)
    assert_close(out, want)
    # ... and a worker killed between two calls fails the next call, naming it.
    pids = list(infer._compiled.engine.worker_pids)
    os.kill(pids[0], signal.SIGKILL)
    assert wait_gone([pids[0]]) == []
    start = time.monotonic()
    with pytest.raises(DeviceError, match=rf"stage 0 on cpu \(pid {pids[0]}\)"):
        infer(x, y)
    assert time.monotonic() - start < 10.0
    assert wait_gone(pids) == []
    assert records_of(os.getpid()) == []


def test_ctrl_c_during_a_call_interrupts_it_and_stops_the_workers(registry):
    script = Script("interrupt", registry)
    try:
        pids = script.json('{"host"')["pids"]
        script.line(prefix="calling")
        wait_busy(pids[1])  # the last stage computes: the call is under way
        # Ctrl-C in a terminal signals the whole foreground group: the program and its workers.
        os.killpg(script.process.pid, signal.SIGINT)
        signalled = time.monotonic()
        report = script.json('{"interrupted"', timeout=NO_HANG)
        assert time.monotonic() - signalled < 10.0
        assert report["interrupted"] is True, script.output()
        assert report["seconds"] < 30.0
        assert report["alive"] == [], "workers still ran right after the KeyboardInterrupt"
        assert script.finish() == 0, script.output()
        assert wait_gone(pids) == []
    finally:
        script.kill()


def test_destroy_after_a_worker_died_between_calls_releases_the_model(registry):
    """A worker lost while the wrapper sat idle (OOM killer, a stray kill) must not make
    destroy() raise: the user's way out is destroy() and a new wrapper of the same model."""
    torch.manual_seed(0)
    model = TokenNet()
    tokens, labels = token_data(8)
    reference = copy.deepcopy(model)
    plain_train_call(reference, _sgd(reference), tokens, labels, D=1, G=4, R=1)
    wrapper = poptorch.trainingModel(model, options(G=4), optimizer=_sgd(model))
    try:
        wrapper(tokens, labels)  # the device now holds newer weights than the host
        pids = list(wrapper._compiled.engine.worker_pids)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
    except BaseException:
        wrapper.destroy()
        raise
    wrapper.destroy()  # must not raise: the lost weights are reported, not fatal
    assert wait_gone(pids) == [] and not wrapper.isCompiled()
    # The model holds the weights of the last completed call: the workers saved them after it.
    for name, param in reference.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)
    # The model is free again (a model wrapped by a live trainingModel cannot be wrapped twice);
    # building a wrapper starts no worker until its first call.
    poptorch.trainingModel(model, options(G=4), optimizer=_sgd(model)).destroy()
