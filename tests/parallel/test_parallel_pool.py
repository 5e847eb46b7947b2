"""Pre-started workers (parallel/host/pool.py): forked from one warm zygote across wrappers, equal to
fresh processes, and gone with the user's process; a killed zygote is named or replaced."""
import importlib
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from fault_cases import registry  # noqa: F401 - the fixture
from fault_cases import Script, TokenNet, alive, options, script_env, token_data, wait_gone
from pipetorch.errors import ConfigError, DeviceError
from pipetorch.parallel.host import pool, preload



def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


def _threads_after_importing_torch() -> int:
    code = "import os, torch; print(len(os.listdir('/proc/self/task')))"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True).stdout)


def _train_twice(tokens, labels):
    """Two training calls of a fresh TokenNet: (the calls' outputs, the trained weights, the
    workers' pids)."""
    torch.manual_seed(0)
    model = TokenNet()
    wrapper = poptorch.trainingModel(model, options(G=4),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        outputs = [wrapper(tokens, labels) for _ in range(2)]
        pids = list(wrapper._compiled.engine.worker_pids)
        wrapper.copyWeightsToHost()
    finally:
        wrapper.destroy()
    return outputs, {k: v.clone() for k, v in model.state_dict().items()}, pids


@pytest.mark.slow
def test_wrappers_fork_from_one_zygote_and_match_fresh_workers(registry, monkeypatch):
    tokens, labels = token_data(8)
    monkeypatch.setenv("PIPETORCH_WORKER_POOL", "0")
    fresh_out, fresh_weights, _ = _train_twice(tokens, labels)
    monkeypatch.setenv("PIPETORCH_WORKER_POOL", "1")
    pool.shutdown()  # a zygote of its own (an earlier test's may have imported transformers)
    first_out, first_weights, first_pids = _train_twice(tokens, labels)
    zygote = pool.zygote()
    # Only the threads importing torch makes (OpenBLAS's, fork-safe): no intra-op pool, so
    # nothing ran in parallel before a fork.
    assert zygote.thread_count(timeout=30) == _threads_after_importing_torch()
    second_out, second_weights, second_pids = _train_twice(tokens, labels)
    assert pool.zygote() is zygote and zygote.alive()  # one zygote serves every wrapper
    assert set(first_pids).isdisjoint(second_pids)  # each wrapper forks its own workers
    assert wait_gone(first_pids + second_pids) == []
    for out, weights in ((first_out, first_weights), (second_out, second_weights)):
        assert_close(out, fresh_out, rtol=0, atol=0)
        assert_close(weights, fresh_weights, rtol=0, atol=0)
    # Against plain PyTorch: the same two SGD steps of mean-reduced losses over 4 micro-batches.
    torch.manual_seed(0)
    model = TokenNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        sgd.zero_grad()
        for t, y in zip(tokens.chunk(4), labels.chunk(4)):
            (model(t, y)[1] / 4).backward()
        sgd.step()
    assert_close(first_weights, model.state_dict())


_LIBRARY = """import os
import torch.nn as nn
with open({marker!r}, "a") as imports:
    imports.write(f"{{os.getpid()}}\\n")


class Layer(nn.Linear):
    pass
"""


@pytest.mark.slow
def test_a_models_installed_library_is_imported_once_in_the_zygote(registry, tmp_path,
                                                                    monkeypatch):
    """A model whose classes come from an installed library (transformers, for a HuggingFace
    model): the zygote imports it before forking, once for every worker of every wrapper."""
    folder, marker = tmp_path / "site-packages", tmp_path / "imports"
    folder.mkdir()
    name = f"layers_{tmp_path.name.replace('-', '_')}"
    (folder / f"{name}.py").write_text(_LIBRARY.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(preload, "_site_folders", lambda: (f"{folder}/",))
    library = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, library)  # gone again when the test ends
    x = torch.randn(4, 4)
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(library.Layer(4, 4),
                                    poptorch.BeginBlock(library.Layer(4, 2), ipu_id=1))
        assert preload.libraries(model) == (name,)
        wrapper = poptorch.inferenceModel(model, options(D=2, G=1))
        try:
            assert_close(wrapper(x), model(x))
            pids = wrapper._compiled.engine.worker_pids
            assert all(_parent(p) == pool.zygote().process.pid for p in pids)
        finally:
            wrapper.destroy()
    # this process's import, then the zygote's; none in the four workers
    assert marker.read_text().split() == [str(os.getpid()), str(pool.zygote().process.pid)]


@pytest.mark.slow
def test_a_library_the_zygote_cannot_import_is_left_to_the_workers(registry, tmp_path,
                                                                   monkeypatch):
    """The model's library went from disk after the user's process imported it: the zygote's
    import fails, and the zygote goes on forking workers (who import what they need)."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    name = f"gone_{tmp_path.name.replace('-', '_')}"
    (folder / f"{name}.py").write_text("import torch.nn as nn\n\n\nclass Layer(nn.Linear):\n"
                                       "    pass\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(preload, "_site_folders", lambda: (f"{folder}/",))
    library = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, library)
    (folder / f"{name}.py").unlink()
    torch.manual_seed(0)
    model = torch.nn.Sequential(library.Layer(4, 4),
                                poptorch.BeginBlock(library.Layer(4, 2), ipu_id=1))
    zygote = pool.zygote()
    wrapper = poptorch.inferenceModel(model, options(D=2, G=1))
    try:
        x = torch.randn(4, 4)
        assert_close(wrapper(x), model(x))
    finally:
        wrapper.destroy()
    assert pool.zygote() is zygote and zygote.alive()


@pytest.mark.slow
def test_a_killed_zygote_leaves_running_wrappers_alone_and_is_replaced(registry, caplog):
    tokens, labels = token_data(8)
    torch.manual_seed(0)
    model = TokenNet()
    wrapper = poptorch.inferenceModel(model, options(D=2, G=1))
    try:
        want, _ = wrapper(tokens, labels)
        dead = pool.zygote()
        pids = list(wrapper._compiled.engine.worker_pids)
        assert all(_parent(p) == dead.process.pid for p in pids)
        os.kill(dead.process.pid, signal.SIGKILL)
        dead.process.wait(10)
        start = time.monotonic()
        with pytest.raises(DeviceError, match=rf"worker pool process \(pid {dead.process.pid}\) "
                                              r"died \(exit code -9\)"):
            dead.fork(timeout=60)
        assert time.monotonic() - start < 5
        time.sleep(0.5)
        assert all(alive(p) for p in pids)  # the workers watch the user's process, not it
        out, _ = wrapper(tokens, labels)
        assert_close(out, want)
        with caplog.at_level(logging.WARNING, logger="pipetorch.parallel.host.pool"):
            again = poptorch.inferenceModel(TokenNet(), options(D=2, G=1))
            try:
                again(tokens, labels)
            finally:
                again.destroy()
        assert f"pool process (pid {dead.process.pid}) has exited" in caplog.text
        assert pool.zygote() is not dead
    finally:
        wrapper.destroy()
    assert wait_gone(pids) == []


def test_the_zygote_starts_again_for_a_changed_variable_not_for_the_test_running(monkeypatch):
    """A variable torch's imports may read, changed, takes a new zygote; pytest's name of the
    test running, which changes at every test of a suite, does not (it took seconds a test)."""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::test_one (call)")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    pool.shutdown()  # the zygote of the tests before, started without OMP_NUM_THREADS
    first = pool.zygote()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::test_two (call)")
    assert pool.zygote() is first and first.alive()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    second = pool.zygote()
    assert second is not first and not first.alive() and second.alive()
    monkeypatch.undo()
    assert pool.zygote() is not second  # and back again, for the tests after this one


@pytest.mark.slow
def test_user_process_killed_takes_the_zygote_with_it(registry):
    script = Script("linger", registry)
    try:
        started = script.json('{"host"')
        pids = started["pids"]
        zygote = _parent(pids[0])
        assert zygote != started["host"] and _parent(zygote) == started["host"]
        os.kill(started["host"], signal.SIGKILL)
        script.process.wait(10)
        assert wait_gone([zygote, *pids], timeout=5.0) == []
    finally:
        script.kill()


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_pool_setting_names_the_values_it_takes(monkeypatch, value):
    monkeypatch.setenv("PIPETORCH_WORKER_POOL", value)
    with pytest.raises(ConfigError, match=rf"PIPETORCH_WORKER_POOL='{value}' must be 1 .*early"
                                          r".* or 0"):
        pool.enabled()


_FROM_ELSEWHERE = """
import torch, pipetorch as poptorch
model = torch.nn.Sequential(torch.nn.Linear(4, 4), poptorch.BeginBlock(torch.nn.Linear(4, 2),
                                                                      ipu_id=1))
wrapper = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
torch.testing.assert_close(wrapper(torch.ones(2, 4)), model(torch.ones(2, 4)))
wrapper.destroy()
print("same as plain")
"""


# Workers started with `python -m` took the current folder first on their import path: run
# from a folder holding another `pipetorch` (a checkout, an old copy), they imported that one,
# not the user's process's.
@pytest.mark.slow
@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is Python 3.11's")
@pytest.mark.parametrize("pooled", ["1", "0"], ids=["pool", "fresh"])
def test_workers_import_the_pipetorch_the_user_imported_whatever_the_folder(
        registry, tmp_path, pooled):
    elsewhere = tmp_path / "folder" / "pipetorch"
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("raise ImportError('the pipetorch in the folder')\n")
    script = tmp_path / "job.py"
    script.write_text(_FROM_ELSEWHERE)
    env = script_env(registry)
    root = os.path.dirname(os.path.dirname(poptorch.__file__))
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]])
    env["PIPETORCH_WORKER_POOL"] = pooled
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path / "folder", env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same as plain" in done.stdout, done.stdout + done.stderr


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[16])


# Workers lower their priority (PIPETORCH_WORKER_NICE, default 10) so that the user's process,
# on every step's path, gets a core first on a machine with fewer cores than busy processes.
# Every worker applies it in serve.main, forked or spawned: each value on the pool's workers,
# and one on spawned workers (that the variable reaches them), not the matrix of both.
@pytest.mark.slow
@pytest.mark.parametrize("pooled, nice", [("1", None), ("1", "0"), ("1", "3"), ("0", "3")],
                         ids=["default-pool", "off-pool", "3-pool", "3-fresh"])
def test_workers_run_at_the_niceness_asked(registry, monkeypatch, pooled, nice):
    monkeypatch.setenv("PIPETORCH_WORKER_POOL", pooled)
    if nice is not None:
        monkeypatch.setenv("PIPETORCH_WORKER_NICE", nice)
    tokens, labels = token_data(8)
    model = TokenNet()
    wrapper = poptorch.trainingModel(model, options(G=4),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        wrapper(tokens, labels)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        want = min(19, mine + (10 if nice is None else int(nice)))
        pids = wrapper._compiled.engine.worker_pids
        assert [_niceness(pid) for pid in pids] == [want] * len(pids)
    finally:
        wrapper.destroy()


def test_a_bad_worker_niceness_is_refused_in_the_users_process(registry, monkeypatch):
    monkeypatch.setenv("PIPETORCH_WORKER_NICE", "25")
    tokens, labels = token_data(8)
    model = TokenNet()
    wrapper = poptorch.trainingModel(model, options(G=4),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with pytest.raises(ConfigError, match="PIPETORCH_WORKER_NICE='25' must be a whole "
                                              "number from 0"):
            wrapper(tokens, labels)
    finally:
        wrapper.destroy()
