"""destroy(), the interpreter's exit and the user's process dying leave no worker behind.

Counts the worker processes (by pid), their registry records, the /dev/shm entries and the
shared memory files this process holds before and after; the exit and death cases run a
user's program in its own interpreter.
"""
import gc
import os
import signal
import threading
import time

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from fault_cases import registry  # noqa: F401 - the fixture
from fault_cases import (Script, TokenNet, alive, memory_files, new_shm_entries, options,
                         records_of,
                         shm_entries, token_data, wait_gone, wait_no_records)
from pipetorch.parallel.layout import placement

pytestmark = pytest.mark.slow


def _registry_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if f.startswith("worker-"))


def test_destroy_stops_the_workers_and_removes_their_files(registry):
    shm_before, files_before = shm_entries(), memory_files()
    torch.manual_seed(0)
    model = TokenNet()
    wrapper = poptorch.trainingModel(model, options(G=4),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        tokens, labels = token_data(8)
        wrapper(tokens, labels)
        engine = wrapper._compiled.engine
        pids = list(engine.worker_pids)
        folder = engine.workers.folder
        assert len(pids) == 2 and all(alive(p) for p in pids)
        records = sorted(records_of(os.getpid()), key=lambda r: r["ipu"])
        threads = max(1, placement.cpu_cores() // 2)
        assert records == [
            {"stages": [s], "ipu": s, "device": "cpu", "threads": threads, "replica": 0, "pid": pids[s],
             "host_pid": os.getpid()} for s in range(2)]
        assert _registry_files(registry) == sorted(f"worker-{p}.json" for p in pids)
        assert os.path.isdir(folder)
        assert memory_files() - files_before  # the calls' inputs and outputs
    finally:
        wrapper.destroy()
    # destroy() waits for the workers: nothing is left the moment it returns.
    assert [p for p in pids if alive(p)] == []
    assert engine.worker_pids == []
    assert records_of(os.getpid()) == [] and _registry_files(registry) == []
    assert not os.path.exists(folder)
    assert new_shm_entries(shm_before) == set()
    gc.collect()
    assert memory_files() - files_before == set()
    wrapper.destroy()  # a second destroy() is harmless


def test_interpreter_exit_without_destroy_stops_the_workers(registry):
    shm_before = shm_entries()
    script = Script("exit", registry)
    try:
        started = script.json('{"host"')
        assert len(started["pids"]) == 2
        assert script.finish() == 0, script.output()
        # The program has exited: its workers must be gone (allow them a moment to be reaped).
        assert wait_gone(started["pids"]) == []
        assert records_of(started["host"]) == []
        assert _registry_files(registry) == []  # they unregistered themselves, not pruned
        assert not os.path.exists(started["folder"])
        assert new_shm_entries(shm_before) == set()
    finally:
        script.kill()


def test_user_process_killed_takes_its_workers_with_it(registry):
    script = Script("linger", registry)
    try:
        started = script.json('{"host"')
        pids = started["pids"]
        assert all(alive(p) for p in pids)
        os.kill(started["host"], signal.SIGKILL)  # only the program: its workers must follow
        script.process.wait(10)
        assert wait_gone(pids, timeout=5.0) == [], "workers outlived their killed parent"
        # Their records stay (a killed worker cannot unregister) but must not count as live.
        assert wait_no_records(started["host"]) == []
    finally:
        script.kill()


def test_workers_outlive_the_thread_that_built_the_wrapper(registry):
    """A wrapper built in a helper thread (e.g. a background compile) stays usable after the
    thread ends: workers must die with the user's process, not with the thread that made them."""
    torch.manual_seed(0)
    model = TokenNet()
    tokens, labels = token_data(8)
    made = {}

    def build():
        made["wrapper"] = poptorch.inferenceModel(model, options(D=2, G=1))
        try:
            made["wrapper"](tokens, labels)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            made["error"] = exc

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(120)
    wrapper = made["wrapper"]
    try:
        if "error" in made:
            raise made["error"]
        pids = list(wrapper._compiled.engine.worker_pids)
        time.sleep(0.5)
        assert [p for p in pids if not alive(p)] == [], "workers died with the building thread"
        out, _ = wrapper(tokens, labels)
        with torch.no_grad():
            want, _ = model(tokens, labels)
        assert_close(out, want)
    finally:
        wrapper.destroy()
    assert wait_gone(pids) == []
