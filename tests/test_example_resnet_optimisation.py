"""examples/resnet_optimisation.py (seed 002's day) and its CIFAR-10 data module."""
from __future__ import annotations

import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Width 4, one block per layer, micro-batches of 2: seconds per run on a busy CPU.
TINY = ("--width", "4", "--blocks", "1", "--batch-size", "2", "--gradient-accumulation", "3")
EPOCH = re.compile(r"\[Epoch (\d\d)\] loss: (\d+\.\d{3}|nan|inf), acc: (\d+\.\d)")
THROUGHPUT = re.compile(r"Throughput: (\d+\.\d) images/s \((\d+) images in (\d+\.\d\d) s, "
                        r"(\d+) epoch\(s\)\)\.")


@pytest.fixture
def cifar(monkeypatch):
    """examples/cifar_data.py, imported as the example imports it (its folder on sys.path)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import cifar_data
    return cifar_data


def batch_dict(images: np.ndarray, labels: list[int], *, byte_keys: bool = True) -> dict:
    """A CIFAR-10 python batch: N x 3072 uint8 rows, as CIFAR's own (Python 2) pickles hold."""
    data = images.reshape(len(images), -1)
    if byte_keys:
        return {b"batch_label": b"test", b"data": data, b"labels": labels}
    return {"data": data, "labels": labels}


def write_cifar(root: Path, per_batch: int, *, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """cifar-10-batches-py under root with 5 training batches and a test batch of per_batch
    random images each; returns the training images and labels in file order."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    all_images, all_labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        (folder / name).write_bytes(pickle.dumps(batch_dict(images, labels), protocol=2))
        if name != "test_batch":
            all_images.append(images)
            all_labels += labels
    return np.concatenate(all_images), all_labels


def run(*args: str) -> subprocess.CompletedProcess:
    # One intra-op thread: the two stage workers share the CI machine's few cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "examples/resnet_optimisation.py", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=150)


def epochs(stdout: str) -> list[tuple[int, float, float]]:
    return [(int(m[1]), float(m[2]), float(m[3])) for m in EPOCH.finditer(stdout)]


def test_a_batch_is_read_as_red_green_blue_planes_of_rows(cifar, tmp_path: Path) -> None:
    images = np.zeros((2, 3, 32, 32), dtype=np.uint8)
    images[0, 0], images[0, 1], images[0, 2] = 10, 20, 30
    images[1, 2, 5, 7] = 99  # blue plane, row 5, column 7
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(batch_dict(images, [3, 9])))
    read_images, labels = cifar.read_batch(path)
    assert read_images.dtype == torch.uint8 and read_images.shape == (2, 3, 32, 32)
    assert read_images[0, :, 0, 0].tolist() == [10, 20, 30]
    assert read_images[1, 2, 5, 7].item() == 99 and read_images[1].sum().item() == 99
    assert labels.dtype == torch.int64 and labels.tolist() == [3, 9]


def test_str_keys_are_read_too(cifar, tmp_path: Path) -> None:
    path = tmp_path / "test_batch"
    images = np.full((1, 3, 32, 32), 7, dtype=np.uint8)
    path.write_bytes(pickle.dumps(batch_dict(images, [4], byte_keys=False)))
    read_images, labels = cifar.read_batch(path)
    assert torch.equal(read_images, torch.from_numpy(images)) and labels.tolist() == [4]


def test_the_five_training_batches_are_joined_in_order(cifar, tmp_path: Path) -> None:
    images, labels = write_cifar(tmp_path, 3)
    # --data-dir may name the extracted folder or the folder holding it.
    for data_dir in (tmp_path, tmp_path / "cifar-10-batches-py"):
        train_images, train_labels = cifar.read_cifar(data_dir, "train")
        assert torch.equal(train_images, torch.from_numpy(images))
        assert train_labels.tolist() == labels
    first, first_labels = cifar.read_cifar(tmp_path, "train", max_items=4)
    assert torch.equal(first, torch.from_numpy(images[:4])) and first_labels.tolist() == labels[:4]
    test_images, _ = cifar.read_cifar(tmp_path, "test")
    assert test_images.shape == (3, 3, 32, 32)


def test_missing_files_are_named_with_the_fix(cifar, tmp_path: Path) -> None:
    write_cifar(tmp_path, 1)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(cifar.DataError) as err:
        cifar.read_cifar(tmp_path, "train")
    assert str(err.value) == (
        f"{tmp_path / 'cifar-10-batches-py'} lacks data_batch_4: point --data-dir at the folder "
        "extracted from cifar-10-python.tar.gz (the one holding cifar-10-batches-py), or leave "
        "--data-dir out to train on generated images.")


@pytest.mark.parametrize("payload, message", [
    (b"\x80\x02}q\x00", "not a readable pickle"),
    (pickle.dumps([1, 2]), "holds a list, not the dict of a CIFAR-10 python batch"),
    (pickle.dumps({b"labels": [1]}), "no 'data' entry (it has ['labels'])"),
    (pickle.dumps({b"data": np.zeros((1, 100), np.uint8), b"labels": [1]}),
     "'data' is uint8 of shape (1, 100); CIFAR-10 images are uint8 rows of 3072 values"),
    (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}),
     "1 labels for 2 images"),
    (pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}),
     "labels range over 10..10; CIFAR-10 has 10 classes (0..9)"),
])
def test_malformed_batches_are_refused_naming_the_file(cifar, tmp_path: Path, payload: bytes,
                                                       message: str) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(payload)
    with pytest.raises(cifar.DataError) as err:
        cifar.read_batch(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_generated_images_are_seeded_uint8_and_learnable(cifar) -> None:
    images, labels = cifar.generated_images(400, seed=3)
    again, again_labels = cifar.generated_images(400, seed=3)
    assert torch.equal(images, again) and torch.equal(labels, again_labels)
    assert images.dtype == torch.uint8 and images.shape == (400, 3, 32, 32)
    assert set(labels.tolist()) == set(range(10))
    # Class means differ far more than the noise of a mean over ~40 images, and a flip keeps
    # them: the nearest class mean recognises the flipped images.
    means = torch.stack([images[labels == c].float().mean(0) for c in range(10)])
    flipped = images.flip(-1).float()
    nearest = torch.cdist(flipped.flatten(1), means.flatten(1)).argmin(1)
    assert (nearest == labels).float().mean().item() > 0.95


def test_the_dataset_yields_uint8_or_normalised_images(cifar) -> None:
    images, labels = cifar.generated_images(4, seed=0)
    raw = cifar.CifarImages(images, labels, flip=False, dtype=None)
    assert torch.equal(raw[1][0], images[1]) and raw[1][1].item() == labels[1].item()
    half = cifar.CifarImages(images, labels, flip=False, dtype=torch.float16)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    expected = ((images[2].float() / 255 - mean) / std).half()
    assert half[2][0].dtype == torch.float16
    torch.testing.assert_close(half[2][0], expected)
    with pytest.raises(ValueError, match=r"takes uint8 images N x C x H x W and N labels; got "
                                         r"torch.float32 \(4, 3, 32, 32\) and 4 labels"):
        cifar.CifarImages(images.float(), labels, flip=False, dtype=None)


def test_resize_keeps_uint8(cifar) -> None:
    images = torch.full((2, 3, 32, 32), 200, dtype=torch.uint8)
    resized = cifar.resize(images, 64)
    assert resized.dtype == torch.uint8 and resized.shape == (2, 3, 64, 64)
    assert torch.equal(resized, torch.full_like(resized, 200))


def test_an_unknown_split_block_is_refused_with_the_choices() -> None:
    proc = run(*TINY, "--dataset-size", "12", "--split-at", "layer9.0")
    assert proc.returncode == 1
    assert ("--split-at layer9.0: the model has no such block; choose one of layer1.0, layer2.0, "
            "layer3.0, layer4.0") in proc.stderr


def test_a_data_dir_without_cifar_says_so(tmp_path: Path) -> None:
    proc = run(*TINY, "--data-dir", str(tmp_path))
    assert proc.returncode == 1
    assert f"{tmp_path} lacks data_batch_1, data_batch_2" in proc.stderr


@pytest.mark.slow
def test_fp32_training_on_cifar_files_prints_the_seeds_epoch_lines(tmp_path: Path) -> None:
    write_cifar(tmp_path, 6)  # 30 training images
    proc = run(*TINY, "--precision", "32.32", "--epochs", "2", "--data-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Namespace(batch_size=2, precision='32.32', gradient_accumulation=3")
    assert lines[1] == f"Data: 30 CIFAR-10 training images from {tmp_path}."
    assert lines[2].endswith("BeginBlock at layer3.0: ipu 0 runs the layers before it, ipu 1 it "
                             "and the rest (pipelined).")
    assert lines[3] == ("Precision 32.32: float32 images to the device, float32 model; Sync "
                        "data loader.")
    assert lines[4] == ("Batching: batch size 2 x gradient accumulation 3 x replicas 1 x device "
                        "iterations 1 = 6 images per call (73728 bytes of images), 5 calls per "
                        "epoch.")
    assert [(epoch, math.isfinite(loss)) for epoch, loss, _ in epochs(proc.stdout)] == [
        (1, True), (2, True)]
    throughput = THROUGHPUT.fullmatch(lines[-1])
    assert throughput, lines[-1]
    assert throughput.group(2, 4) == ("60", "2") and float(throughput[1]) > 0
    assert "[Epoch 01]: 100%" in proc.stderr  # the seed's progress bar


@pytest.mark.slow
def test_half_precision_with_eight_bit_io_and_the_async_loader() -> None:
    proc = run(*TINY, "--precision", "16.16", "--eight-bit-io", "--async-dataloader",
               "--device-iterations", "2", "--dataset-size", "24", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("Data: 24 generated 32x32 images of 10 classes (no --data-dir")
    assert lines[3] == ("Precision 16.16: uint8 images to the device (normalised there), "
                        "float16 model; Async data loader.")
    # uint8 over the wire: a quarter of fp32's bytes (12 images of 3 x 32 x 32).
    assert "= 12 images per call (36864 bytes of images), 2 calls per epoch." in lines[4]
    losses = [loss for _, loss, _ in epochs(proc.stdout)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), proc.stdout
    assert THROUGHPUT.fullmatch(lines[-1]), lines[-1]
