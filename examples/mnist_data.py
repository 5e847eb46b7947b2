"""Digits for mnist_pipeline.py: MNIST's IDX files (parsed, checked, downloaded), sklearn's digits.

MNIST comes as four IDX files, gzipped or not. An IDX file is a big-endian header (two zero
bytes, a type code, the number of dimensions, then each dimension as a uint32) followed by the
values; MNIST's images are magic 2051 (uint8, 3 dimensions: N x 28 x 28) and its labels magic
2049 (uint8, 1 dimension: N). Nothing is downloaded unless `download_mnist` is called.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import struct
import urllib.error
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

# split -> (image file, label file), without the .gz suffix
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_MD5 = {  # of the gzipped files every MNIST mirror serves
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/",
           "https://storage.googleapis.com/cvdf-datasets/mnist/")
IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of MNIST's training pixels scaled to [0, 1]
DIGITS_TEST_ITEMS = 320  # 1797 digits: 1477 to train on, 320 (4 inference calls of 8 x 10) to test

# IDX type code -> numpy big-endian dtype
IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DataError(ValueError):
    """A data file is missing, malformed or could not be fetched (the message names it)."""


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":  # gzip's magic: a file is gzipped whatever its name says
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: the gzip stream is damaged or truncated ({err}); delete the "
                        "file and fetch it again (e.g. with --download).") from None


def read_idx(path: str | os.PathLike) -> tuple[int, np.ndarray]:
    """The magic number and the array of an IDX file (gzipped or plain), checked for size."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataError(f"{path}: {len(data)} bytes is too short for an IDX header (4 bytes "
                        "of magic number); the file is truncated or not an IDX file.")
    magic = struct.unpack(">I", data[:4])[0]
    zeros, type_code, ndim = data[0:2], data[2], data[3]
    if zeros != b"\x00\x00" or type_code not in IDX_TYPES or ndim == 0:
        raise DataError(f"{path}: bad magic number 0x{magic:08X}: an IDX file starts with two "
                        f"zero bytes, a type code in {sorted(f'0x{t:02X}' for t in IDX_TYPES)} "
                        "and a dimension count of at least 1. Is this an MNIST IDX file?")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path}: truncated header: magic 0x{magic:08X} announces {ndim} "
                        f"dimensions ({header} header bytes) but the file has {len(data)} bytes.")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(IDX_TYPES[type_code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = len(data) - header
    if found != expected:
        kind = "truncated" if found < expected else "too long"
        raise DataError(f"{path}: {kind}: the header's shape {tuple(shape)} of {dtype.name} "
                        f"needs {expected} data bytes, the file has {found}. Delete the file and "
                        "fetch it again (e.g. with --download).")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return magic, array.astype(dtype.newbyteorder("="))


def find_mnist_file(data_dir: str | os.PathLike, name: str) -> Path | None:
    """`name` or `name.gz` in data_dir or in torchvision's layout under it (MNIST/raw)."""
    for folder in (Path(data_dir), Path(data_dir) / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def missing_mnist_files(data_dir: str | os.PathLike) -> list[str]:
    """The MNIST file names (without .gz) found neither plain nor gzipped in data_dir."""
    names = [name for pair in MNIST_FILES.values() for name in pair]
    return [name for name in names if find_mnist_file(data_dir, name) is None]


def load_mnist_split(data_dir: str | os.PathLike, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 28, 28] uint8, labels [N] uint8) of the "train" or "test" split."""
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}.")
    found = []
    for name in MNIST_FILES[split]:
        path = find_mnist_file(data_dir, name)
        if path is None:
            raise DataError(f"{name}[.gz] is not in {Path(data_dir).resolve()}: pass --download "
                            "to fetch MNIST there, or copy the four IDX files into it.")
        found.append(path)
    (image_path, label_path) = found
    image_magic, images = read_idx(image_path)
    label_magic, labels = read_idx(label_path)
    if image_magic != IMAGE_MAGIC or images.dtype != np.uint8 or images.shape[1:] != (28, 28):
        raise DataError(f"{image_path}: expected MNIST images (magic {IMAGE_MAGIC}, uint8, N x 28 "
                        f"x 28), got magic {image_magic}, {images.dtype.name}, shape "
                        f"{images.shape}.")
    if label_magic != LABEL_MAGIC or labels.dtype != np.uint8:
        raise DataError(f"{label_path}: expected MNIST labels (magic {LABEL_MAGIC}, uint8, N), "
                        f"got magic {label_magic}, {labels.dtype.name}, shape {labels.shape}.")
    if len(images) != len(labels):
        raise DataError(f"{image_path} holds {len(images)} images but {label_path} holds "
                        f"{len(labels)} labels: the two files come from different sets.")
    if labels.size and labels.max() > 9:
        raise DataError(f"{label_path}: label {int(labels.max())} is not a digit (0-9).")
    return images, labels


def mnist_datasets(data_dir: str | os.PathLike, *, max_train_items: int | None = None
                   ) -> tuple[TensorDataset, TensorDataset]:
    """MNIST's (train, test) as normalised 1x28x28 float tensors and int64 labels."""
    def dataset(split: str, limit: int | None) -> TensorDataset:
        images, labels = load_mnist_split(data_dir, split)
        images, labels = images[:limit], labels[:limit]
        pixels = torch.from_numpy(images).float().unsqueeze(1).div_(255.0)
        return TensorDataset(pixels.sub_(MNIST_MEAN).div_(MNIST_STD),
                             torch.from_numpy(labels).long())

    return dataset("train", max_train_items), dataset("test", None)


def download_mnist(data_dir: str | os.PathLike, *, mirrors: Sequence[str] = MIRRORS,
                   checksums: Mapping[str, str] = MNIST_MD5, timeout: float = 60.0) -> list[Path]:
    """Fetch the gzipped MNIST files missing from data_dir; returns the paths it wrote.

    Each file is tried on every mirror in turn, checked against its MD5 and only then moved
    into place, so an interrupted or corrupted download never leaves a file that looks valid.
    """
    folder = Path(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in missing_mnist_files(folder):
        gz_name = f"{name}.gz"
        target, partial = folder / gz_name, folder / f"{gz_name}.part"
        failures = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + gz_name
            print(f"Downloading {url}", flush=True)
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    payload = response.read()
            except (urllib.error.URLError, OSError) as err:
                failures.append(f"{url}: {getattr(err, 'reason', err)}")
                continue
            digest = hashlib.md5(payload).hexdigest()
            if digest != checksums[gz_name]:
                failures.append(f"{url}: MD5 {digest} instead of {checksums[gz_name]}")
                continue
            partial.write_bytes(payload)
            os.replace(partial, target)
            written.append(target)
            break
        else:
            raise DataError(f"Could not download {gz_name} into {folder.resolve()}: "
                            + "; ".join(failures) + ". Check the network connection (or copy "
                            "the four MNIST IDX files there by hand), or use --dataset digits, "
                            "which needs no download.")
    return written


def digits_datasets(*, test_items: int = DIGITS_TEST_ITEMS, seed: int = 0,
                    max_train_items: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled digits as MNIST-like 1x28x28 tensors, split into (train, test).

    The split is a fixed permutation of `seed`; both sets are normalised with the training
    set's mean and standard deviation, as MNIST's (0.1307, 0.3081) are.
    """
    from sklearn.datasets import load_digits  # only this dataset needs scikit-learn

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    test_idx, train_idx = order[:test_items], order[test_items:]
    if max_train_items is not None:
        train_idx = train_idx[:max_train_items]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))
