"""examples/mnist_pipeline.py and its data module: IDX parsing, downloads, settings, runs."""
from __future__ import annotations

import gzip
import hashlib
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRAIN_IMAGES, TRAIN_LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"
TEST_IMAGES, TEST_LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"


@pytest.fixture
def examples(monkeypatch):
    """The example modules, imported as the script imports them (its folder on sys.path)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import mnist_data
    import mnist_pipeline
    return mnist_data, mnist_pipeline


def idx_bytes(array: np.ndarray, type_code: int) -> bytes:
    header = struct.pack(">BBBB", 0, 0, type_code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, payload: bytes, *, gz: bool) -> Path:
    if gz:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


def mnist_arrays(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Digits 0 and 1 as dark and bright images (with noise): learnable in a few steps."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(count) % 2).astype(np.uint8)
    images = rng.integers(0, 60, size=(count, 28, 28), dtype=np.uint8)
    images[labels == 1] += 190
    return images, labels


def write_mnist(folder: Path, *, train: int = 48, test: int = 16, gz: bool = True) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for (images_name, labels_name), count, seed in (((TRAIN_IMAGES, TRAIN_LABELS), train, 1),
                                                    ((TEST_IMAGES, TEST_LABELS), test, 2)):
        images, labels = mnist_arrays(count, seed)
        write(folder / images_name, idx_bytes(images, 0x08), gz=gz)
        write(folder / labels_name, idx_bytes(labels, 0x08), gz=not gz)  # both kinds mixed
        arrays[images_name], arrays[labels_name] = images, labels
    return arrays


# -- the IDX parser -------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_returns_exactly_what_was_written(examples, tmp_path, gz) -> None:
    mnist_data, _ = examples
    images = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    magic, read = mnist_data.read_idx(write(tmp_path / "images", idx_bytes(images, 0x08), gz=gz))
    assert magic == 2051 and read.dtype == np.uint8
    np.testing.assert_array_equal(read, images)
    magic, read = mnist_data.read_idx(write(tmp_path / "labels", idx_bytes(labels, 0x08), gz=gz))
    assert magic == 2049
    np.testing.assert_array_equal(read, labels)


def test_read_idx_reads_big_endian_wider_types(examples, tmp_path) -> None:
    mnist_data, _ = examples
    shorts = np.array([[-2, 300, 7], [32767, -32768, 0]], dtype=np.int16)
    floats = np.array([1.5, -2.25, 1e-3], dtype=np.float32)
    magic, read = mnist_data.read_idx(write(tmp_path / "s", idx_bytes(shorts, 0x0B), gz=False))
    assert magic == 0x0B02 and read.dtype == np.int16
    np.testing.assert_array_equal(read, shorts)
    _, read = mnist_data.read_idx(write(tmp_path / "f", idx_bytes(floats, 0x0D), gz=True))
    np.testing.assert_array_equal(read, floats)


def test_read_idx_rejects_a_bad_magic_number(examples, tmp_path) -> None:
    mnist_data, _ = examples
    path = write(tmp_path / "bad", b"\x01\x02\x08\x03" + bytes(20), gz=False)
    with pytest.raises(mnist_data.DataError, match=r"bad magic number 0x01020803") as err:
        mnist_data.read_idx(path)
    assert str(path) in str(err.value)
    unknown_type = write(tmp_path / "type", b"\x00\x00\x07\x01" + bytes(8), gz=True)
    with pytest.raises(mnist_data.DataError, match=r"type\.gz: bad magic number 0x00000701"):
        mnist_data.read_idx(unknown_type)


def test_read_idx_rejects_truncated_and_overlong_files(examples, tmp_path) -> None:
    mnist_data, _ = examples
    payload = idx_bytes(np.zeros((3, 28, 28), dtype=np.uint8), 0x08)
    short = write(tmp_path / "short", payload[:-10], gz=False)
    with pytest.raises(mnist_data.DataError, match=re.escape(
            f"{short}: truncated: the header's shape (3, 28, 28) of uint8 needs 2352 data "
            "bytes, the file has 2342.")):
        mnist_data.read_idx(short)
    long = write(tmp_path / "long", payload + b"\x00", gz=True)
    with pytest.raises(mnist_data.DataError, match="long.gz: too long: .* the file has 2353"):
        mnist_data.read_idx(long)
    header = write(tmp_path / "header", payload[:9], gz=False)
    with pytest.raises(mnist_data.DataError, match="header: truncated header: .* 3 dimensions "
                                                   r"\(16 header bytes\) but the file has 9"):
        mnist_data.read_idx(header)
    cut_gzip = tmp_path / "cut.gz"
    cut_gzip.write_bytes(gzip.compress(payload)[:-12])
    with pytest.raises(mnist_data.DataError, match="cut.gz: the gzip stream is damaged"):
        mnist_data.read_idx(cut_gzip)


# -- MNIST files ------------------------------------------------------------------------------
def test_mnist_datasets_normalise_the_files_pixels(examples, tmp_path) -> None:
    mnist_data, _ = examples
    arrays = write_mnist(tmp_path / "MNIST" / "raw", train=6, test=4)  # torchvision's layout
    train, test = mnist_data.mnist_datasets(tmp_path, max_train_items=5)
    images, labels = train.tensors
    assert images.shape == (5, 1, 28, 28) and images.dtype == torch.float32
    expected = (torch.from_numpy(arrays[TRAIN_IMAGES][:5]).float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(images[:, 0], expected)
    assert labels.tolist() == arrays[TRAIN_LABELS][:5].tolist() and labels.dtype == torch.int64
    assert test.tensors[1].tolist() == arrays[TEST_LABELS].tolist()


def test_mnist_files_are_checked_against_each_other(examples, tmp_path) -> None:
    mnist_data, _ = examples
    write_mnist(tmp_path, train=6, test=4, gz=False)
    images, _ = mnist_arrays(5, 0)  # one image fewer than the 6 labels
    write(tmp_path / TRAIN_IMAGES, idx_bytes(images, 0x08), gz=False)
    with pytest.raises(mnist_data.DataError, match="holds 5 images but .* holds 6 labels"):
        mnist_data.load_mnist_split(tmp_path, "train")
    # the labels file where the images are expected: its magic says so
    (tmp_path / TEST_IMAGES).write_bytes((tmp_path / f"{TEST_LABELS}.gz").read_bytes())
    with pytest.raises(mnist_data.DataError, match=f"{TEST_IMAGES}: expected MNIST images "
                                                   r"\(magic 2051.*got magic 2049"):
        mnist_data.load_mnist_split(tmp_path, "test")


def test_download_fetches_missing_files_and_checks_them(examples, tmp_path, capsys) -> None:
    mnist_data, _ = examples
    mirror = tmp_path / "mirror"
    write_mnist(mirror, train=4, test=2, gz=True)
    for path in list(mirror.iterdir()):  # a mirror serves every file gzipped
        if path.suffix != ".gz":
            write(path, path.read_bytes(), gz=True)
            path.unlink()
    checksums = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in mirror.iterdir()}
    target = tmp_path / "data"
    target.mkdir()
    (target / TEST_LABELS).write_bytes(gzip.decompress((mirror / f"{TEST_LABELS}.gz").read_bytes()))

    dead = (tmp_path / "nowhere").as_uri() + "/"
    written = mnist_data.download_mnist(target, mirrors=(dead, mirror.as_uri()),
                                        checksums=checksums)
    assert sorted(p.name for p in written) == sorted(
        f"{n}.gz" for n in (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES))  # the present one skipped
    for path in written:
        assert path.read_bytes() == (mirror / path.name).read_bytes()
    assert f"Downloading {dead}{TRAIN_IMAGES}.gz" in capsys.readouterr().out
    assert mnist_data.missing_mnist_files(target) == []
    assert mnist_data.download_mnist(target, mirrors=(dead,), checksums=checksums) == []


def test_download_errors_name_each_mirror_and_leave_no_file(examples, tmp_path) -> None:
    mnist_data, _ = examples
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / f"{TRAIN_IMAGES}.gz").write_bytes(b"not the real file")
    dead = (tmp_path / "nowhere").as_uri() + "/"
    with pytest.raises(mnist_data.DataError) as err:
        mnist_data.download_mnist(tmp_path / "data", mirrors=(mirror.as_uri(), dead))
    message = str(err.value)
    assert message.startswith(f"Could not download {TRAIN_IMAGES}.gz into {tmp_path / 'data'}: ")
    assert f"MD5 {hashlib.md5(b'not the real file').hexdigest()} instead of " \
           "f68b3c2dcbeaaa9fbdd348bbdeb94873" in message
    assert f"{dead}{TRAIN_IMAGES}.gz: " in message and "Check the network connection" in message
    assert list((tmp_path / "data").iterdir()) == []


# -- the program's settings and messages ----------------------------------------------------
def test_digits_defaults_fit_the_data_and_are_announced(examples) -> None:
    _, program = examples
    args = program.parse_args([])
    line = program.fill_settings(args)
    assert (args.batch_size, args.gradient_accumulation, args.device_iterations,
            args.inference_iterations, args.epochs) == (8, 4, 4, 10, 10)
    assert line == ("Settings chosen for the digits: --batch-size 8 --gradient-accumulation 4 "
                    "--device-iterations 4 --inference-iterations 10 --epochs 10, since the "
                    "seed's MNIST settings (40 x 10 x 10 = 4000 images per training call, 8 x "
                    "100 per test call, 3 epochs) are too big for 1797 images; pass these flags "
                    "to choose others.")
    args = program.parse_args(["--batch-size", "16", "--epochs", "2"])
    assert "Settings chosen for the digits: --gradient-accumulation 4 --device-iterations 4 " \
           "--inference-iterations 10, since" in program.fill_settings(args)
    args = program.parse_args(["--batch-size", "40", "--gradient-accumulation", "10",
                               "--device-iterations", "10", "--inference-iterations", "100",
                               "--epochs", "3"])
    assert program.fill_settings(args) is None


def test_mnist_uses_the_seeds_settings(examples) -> None:
    _, program = examples
    args = program.parse_args(["--dataset", "mnist"])
    assert program.fill_settings(args) is None
    assert (args.batch_size, args.gradient_accumulation, args.device_iterations,
            args.inference_iterations, args.epochs, args.test_batch_size,
            args.learning_rate, args.strategy) == (40, 10, 10, 100, 3, 8, 0.001, "pipelined")


def test_mnist_without_files_says_where_and_how_to_get_them(examples, tmp_path) -> None:
    _, program = examples
    (tmp_path / f"{TRAIN_IMAGES}.gz").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        program.main(["--dataset", "mnist", "--data-dir", str(tmp_path)])
    assert str(exit_info.value) == (
        f"--dataset mnist reads MNIST's IDX files (plain or .gz) from {tmp_path.resolve()} "
        f"(or its MNIST/raw folder), which lacks {TRAIN_LABELS}, {TEST_IMAGES}, {TEST_LABELS}. "
        "Pass --download to fetch them from https://ossci-datasets.s3.amazonaws.com/mnist/, point "
        "--data-dir at them, or use --dataset digits (bundled with scikit-learn, no download).")


def test_broken_mnist_files_end_the_program_with_the_parsers_message(examples, tmp_path) -> None:
    _, program = examples
    write_mnist(tmp_path, train=4, test=2)
    (tmp_path / f"{TEST_IMAGES}.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03" + bytes(5)))
    with pytest.raises(SystemExit, match=f"{TEST_IMAGES}.gz: truncated header"):
        program.main(["--dataset", "mnist", "--data-dir", str(tmp_path)])


def test_download_and_data_dir_need_the_mnist_dataset(examples, capsys) -> None:
    _, program = examples
    for flags in (["--download"], ["--data-dir", "somewhere"]):
        with pytest.raises(SystemExit) as exit_info:
            program.parse_args(flags)
        assert exit_info.value.code == 2
        assert "--data-dir and --download read MNIST's files: add --dataset mnist" in \
            capsys.readouterr().err


# -- whole runs (each starts 2 stage workers twice: training, then inference) -----------------
def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / "mnist_pipeline.py"), *args],
                          capture_output=True, text=True, timeout=180, cwd=EXAMPLES.parent)


@pytest.mark.slow
def test_mnist_files_train_end_to_end(tmp_path) -> None:
    write_mnist(tmp_path, train=48, test=16)
    proc = run_example("--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "1",
                       "--batch-size", "2", "--gradient-accumulation", "3",
                       "--device-iterations", "2", "--test-batch-size", "2",
                       "--inference-iterations", "4", "--learning-rate", "0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[:3] == [
        f"MNIST from {tmp_path}: 48 training and 16 test images; pipelined execution on 2 "
        "devices (B1+B2 | B3+B4).",
        "Training: batch size 2 x gradient accumulation 3 x device iterations 2 = 12 images "
        "per call, 4 calls per epoch, 1 epochs, AdamW lr 0.01.",
        "Test: batch size 2 x device iterations 4 = 8 images per call, 2 calls (16 images)."]
    assert re.fullmatch(r"Epoch 1/1: 48 images at \d+ images/s", lines[-2]), lines[-2]
    # dark 0s and bright 1s: 4 AdamW steps at lr 0.01 tell them apart if labels match images
    assert lines[-1] == "Accuracy on test set: 100.00%"
    assert re.search(r"Loss:\d+\.\d{4} \| Accuracy:\d+\.\d\d%", proc.stderr)


@pytest.mark.slow
def test_sharded_strategy_trains_on_the_digits() -> None:
    proc = run_example("--strategy", "sharded", "--epochs", "1", "--max-train-items", "512",
                       "--debug")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == ("Digits upsampled to 28x28: 512 training and 320 test images; sharded "
                        "execution on 2 devices (B1+B2 | B3+B4).")
    assert lines[2].startswith("Settings chosen for the digits: --batch-size 8 ")
    assert re.fullmatch(r"Epoch 1/1: 512 images at \d+ images/s", lines[-2]), lines[-2]
    match = re.fullmatch(r"Accuracy on test set: (\d+\.\d\d)%", lines[-1])
    assert match and float(match.group(1)) > 30.0, lines[-1]
    assert "pipetorch.parallel.host.engine INFO: Started 2 device worker(s)" in proc.stderr  # --debug
