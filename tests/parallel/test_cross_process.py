"""One pipeline over two torchrun "machines" on 127.0.0.1 (Distributed.stagesAcrossProcesses):
the same numbers as plain PyTorch on every process, and faults raised on every process."""
import json

import pytest
import torch
from torch.testing import assert_close

import torchrun_habits_job as habits
import torchrun_pipeline_job as job
import torchrun_saving_job as saving_job
from helpers.reference import plain_train_call
from helpers.torchrun import two_nodes
from pipetorch.errors import ConfigError
from pipetorch.parallel.host import cross_process
from pipetorch.parallel.layout.placement import Physical, Placement, running
from safetensors.torch import load_file

TIMEOUT = 8  # PIPETORCH_TIMEOUT of the fault jobs, seconds


def plain_calls(replicas: int):
    """Plain PyTorch's losses of each call and its weights after each call."""
    data = job.dataset(replicas)
    call = job.D * job.G * job.B * replicas
    torch.manual_seed(0)
    plain = job.Net()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for c in range(job.CALLS):
        rows = slice(c * call, (c + 1) * call)
        got = plain_train_call(plain, optimizer, data.tensors[0][rows], data.tensors[1][rows],
                               D=job.D, G=job.G, R=replicas)
        yield torch.stack([loss for *_, loss in got]), plain.state_dict()


@pytest.fixture(scope="module")
def training_run(tmp_path_factory) -> dict[str, list[dict]]:
    """One launch of the pipeline job training with 1 replica, then 2, a wrapper each."""
    modes = ("train", "replicas")
    results = two_nodes(job.__file__, tmp_path_factory.mktemp("training"), ",".join(modes))
    return {mode: [result[mode] for result in results] for mode in modes}


@pytest.mark.slow
@pytest.mark.xdist_group("training")
@pytest.mark.timeout(300)  # the first one starts the launch of both modes
@pytest.mark.parametrize("mode, replicas, workers", [("train", 1, 1), ("replicas", 2, 2)])
def test_one_pipeline_over_two_processes_trains_like_plain_pytorch(training_run, mode, replicas,
                                                                   workers):
    results = training_run[mode]
    # each process runs its own stage's workers (of every replica) and no other
    assert [len(r["pids"]) for r in results] == [workers, workers]
    for c, (losses, state) in enumerate(plain_calls(replicas)):
        for p, result in enumerate(results):
            assert_close(result["losses"][c], losses, msg=f"process {p}, call {c}")
            for name, value in state.items():
                assert_close(result["states"][c][name], value, msg=f"process {p}, {name}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "stop", "absent"])
def test_a_fault_on_one_process_raises_on_every_process(tmp_path, mode):
    results = [r[mode] for r in two_nodes(job.__file__, tmp_path, mode,
                                          env={"PIPETORCH_TIMEOUT": str(TIMEOUT)})]
    for p, result in enumerate(results):
        error = result.get("error", "")
        assert "rocess" in error and "stage" in error, (p, error)
        assert result["seconds"] < 3 * TIMEOUT, (p, result["seconds"], error)  # not a hang
        assert not [pid for pid in result["pids"] if running(pid)], (p, error)  # no orphan


@pytest.mark.slow
@pytest.mark.parametrize("where", ["shared", "apart"])
def test_a_pipeline_over_two_processes_saves_each_stage_on_its_process(tmp_path, where):
    """`shared`: one machine (one folder); `apart`: a folder per process, as on machines of
    their own."""
    width = 512  # about 2.1 MB of weights, half on each process
    results = two_nodes(saving_job.__file__, tmp_path, str(width), where)
    torch.manual_seed(0)
    plain = saving_job.TiedNet(width)
    initial = {n: t.detach().clone() for n, t in plain.state_dict().items()}
    optimizer = saving_job.optimizer_of(plain)
    data, call = job.dataset(1), job.D * job.G * job.B
    for c in range(job.CALLS + 1):  # the last: after a reload from the saved files
        rows = slice(c * call, (c + 1) * call) if c < job.CALLS else slice(0, call)
        got = plain_train_call(plain, optimizer, data.tensors[0][rows], data.tensors[1][rows],
                               D=job.D, G=job.G, R=1)
        for result in results:
            losses = result["losses"][c] if c < job.CALLS else result["resumed"]
            assert_close(losses, torch.stack([loss for *_, loss in got]))
        if c == job.CALLS - 1:
            trained = {n: t.detach().clone() for n, t in plain.state_dict().items()}
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    folders = [tmp_path / "trained"] * 2 if where == "shared" else [
        tmp_path / f"machine{p}" / "trained" for p in range(2)]
    index = "model.safetensors.index.json"
    # each process wrote its own stage's file and no other, on its own machine
    assert [r["opened"] for r in results] == [[files[0]], [files[1]]]
    here = [sorted(files + [index])] * 2 if where == "shared" else [[f, index] for f in files]
    assert [r["files"] for r in results] == here
    saved = [load_file(str(folder / f)) for folder, f in zip(folders, files)]
    names = set(load_file(str(tmp_path / "init0.safetensors")))  # the tied weight once
    assert sorted(n for s in saved for n in s) == sorted(names)  # each tensor in one file
    first = {n for n in names if n.startswith(("a.", "mid0."))}
    assert set(saved[0]) == first
    for folder in folders:  # the index names every file, wherever it is
        weight_map = json.loads((folder / index).read_text())["weight_map"]
        assert weight_map == {n: files[n not in first] for n in names}
    for tensors in saved:
        for name, value in tensors.items():
            assert_close(value, trained[name], msg=name)
    for p, result in enumerate(results):
        # one machine: each host maps both files; apart: the other stage keeps what it held,
        # but the tied weight its own stage holds (back.weight, a.weight), kept in memory
        assert set(result["state"]) == set(trained)
        for name, value in trained.items():
            stage = 0 if name.startswith(("a.", "mid0.")) else 1
            current = where == "shared" or stage == p or name in ("a.weight", "back.weight")
            want = value if current else initial[name]
            assert_close(result["state"][name], want, msg=f"process {p}, {name}")
        # the save holds one tensor of its own stage at a time (mid0's or mid1's weight, half
        # the model), never the other's stage: every process holding every stage (each host
        # receiving the other's, and writing the whole model) peaked at 4.5x the model
        assert result["save_peak"] < 0.75 * result["model_bytes"], (p, result["save_peak"])
        if where == "apart":
            assert f"('{files[1 - p]}')" in result["refused"], result["refused"]


def test_devices_are_shared_out_in_blocks_of_processes(monkeypatch):
    placements = [Placement((s,), ipu, "cpu", 1, r) for r in range(2) for s, ipu in
                  enumerate([0, 1, 2, 3])]
    layout = cross_process.spread(placements, (0, 1, 2, 3), process=1, processes=2)
    assert [layout.holder(d) for d in range(4)] == [0, 0, 1, 1]
    mine = cross_process.local_placements(placements, layout)
    assert [(p.ipu, p.replica) for p in mine] == [(2, 0), (3, 0), (2, 1), (3, 1)]
    # on GPUs: this machine's own, from the first; a second process here takes the next ones
    monkeypatch.setattr(cross_process.places, "physical",
                        lambda: Physical(("cuda:0", "cuda:1", "cuda:2", "cuda:3"), 8, None))
    assert [p.device for p in cross_process.local_placements(placements[:4], layout)] == [
        "cuda:0", "cuda:1"]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert [p.device for p in cross_process.local_placements(placements[:4], layout)] == [
        "cuda:2", "cuda:3"]
    with pytest.raises(ConfigError, match="3 ipu"):
        cross_process.spread(placements[:3], (0, 1, 2), process=0, processes=2)


def plain_from(result: dict):
    """Plain PyTorch's losses and weights after each call, from a process's initial weights
    and the batches it fed."""
    plain = job.Net()
    plain.load_state_dict(result["initial"])
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for x, labels in result["batches"]:
        got = plain_train_call(plain, optimizer, x, labels, D=job.D, G=job.G, R=1)
        yield torch.stack([loss for *_, loss in got]), plain.state_dict()


# The habits job's modes that leave both processes running share one launch, each mode with
# a wrapper of its own (a mode's error, as the refusals raise, must not spoil the next one's):
# one torchrun job of two processes for five tests.
HABITS = ("seeded", "seeded-async", "rank0-read", "mismatch", "out-of-step")


@pytest.fixture(scope="module")
def habits_run(tmp_path_factory) -> dict[str, list[dict]]:
    results = two_nodes(habits.__file__, tmp_path_factory.mktemp("habits"), ",".join(HABITS))
    return {mode: [result[mode] for result in results] for mode in HABITS}


@pytest.mark.slow
@pytest.mark.xdist_group("habits")
@pytest.mark.timeout(300)  # the first one starts the launch of all five modes
@pytest.mark.parametrize("mode", ["seeded", "seeded-async"])
def test_per_rank_seeds_give_one_model_and_the_same_batches(habits_run, mode):
    # Data-parallel scripts seed each rank (100 + rank): each process shuffled its own order
    # and built its own initial weights, and stage 0 trained on one process's inputs while
    # the loss stage scored the other's labels, silently.
    results = habits_run[mode]
    assert "error" not in results[0] and "error" not in results[1], results
    assert len(results[0]["batches"]) == job.CALLS
    for (x0, y0), (x1, y1) in zip(results[0]["batches"], results[1]["batches"], strict=True):
        assert_close(x0, x1)
        assert_close(y0, y1)
    for c, (losses, state) in enumerate(plain_from(results[0])):
        for p, result in enumerate(results):
            assert_close(result["losses"][c], losses, msg=f"process {p}, call {c}")
            for name, value in state.items():  # process 0's initial weights won
                assert_close(result["states"][c][name], value, msg=f"process {p}, {name}")


@pytest.mark.slow
@pytest.mark.xdist_group("habits")
@pytest.mark.timeout(300)  # the first one starts the launch of all five modes
def test_inputs_that_differ_between_processes_are_refused_on_every_process(habits_run):
    results = habits_run["mismatch"]
    for p, result in enumerate(results):
        assert result["error"].startswith("InputMismatchError"), (p, result["error"])
        assert "['x']" in result["error"], result["error"]  # the input that differs
        assert result["calls"] == 1, p  # the second call trained nothing
        assert result["seconds"] < 10, (p, result["seconds"])


@pytest.mark.slow
@pytest.mark.xdist_group("habits")
@pytest.mark.timeout(300)  # the first one starts the launch of all five modes
def test_a_read_on_process_0_alone_is_served_by_the_other(habits_run):
    results = habits_run["rank0-read"]
    assert "error" not in results[0] and "error" not in results[1], results
    assert len(results[1]["losses"]) == job.CALLS and not results[1]["states"]
    for c, (losses, state) in enumerate(plain_from(results[0])):
        assert_close(results[1]["losses"][c], losses)
        for name, value in state.items():  # both stages' trained weights, on process 0
            assert_close(results[0]["states"][c][name], value, msg=f"call {c}, {name}")


@pytest.mark.slow
@pytest.mark.xdist_group("habits")
@pytest.mark.timeout(300)  # the first one starts the launch of all five modes
def test_rounds_out_of_step_raise_on_every_process_naming_each(habits_run):
    results = habits_run["out-of-step"]
    for p, result in enumerate(results):
        error = result["error"]
        assert "process 0" in error and "setOptimizer" in error, (p, error)
        assert "process 1" in error and "call 2" in error, (p, error)
        assert result["seconds"] < 10, (p, result["seconds"], error)


@pytest.mark.slow
@pytest.mark.parametrize("dead", [0, 1])
def test_a_process_killed_is_named_by_the_survivor(tmp_path, dead):
    results = [r.get(f"kill{dead}", {}) for r in
               two_nodes(habits.__file__, tmp_path, f"kill{dead}", dies=dead)]
    survivor = results[1 - dead]
    error = survivor["error"]
    assert f"rocess {dead} of 2" in error and f"stage(s) [{dead}]" in error, error
    assert "killed" in error and "Connection reset" not in error.split(". Here:")[0], error
    assert survivor["seconds"] < 10, (survivor["seconds"], error)
    for result in results:  # no worker left on either side
        assert not [pid for pid in result["pids"] if running(pid)], error
