"""Images for resnet_optimisation.py: CIFAR-10's python pickle batches, or a generated stand-in.

CIFAR-10's "python version" is a folder `cifar-10-batches-py` of pickled dicts:
`data_batch_1` .. `data_batch_5` (training, 10000 images each) and `test_batch`. Each holds
`data`, a uint8 array of N x 3072 (the red, green then blue 32x32 planes of each image, rows
first), and `labels`, N class indices in 0..9. Pickle can run code while loading, so read
only files from a source you trust (CIFAR's own archive). Nothing is ever downloaded here.

Both sources give uint8 images N x 3 x 32 x 32; `CifarImages` turns them into what the model
reads: uint8 as they are (8-bit I/O: the model normalises them) or normalised floats.
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
           "dog", "frog", "horse", "ship", "truck")
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
SIDE = 32
# The seed normalises with ImageNet's statistics (of pixels scaled to [0, 1]).
IMAGENET_STATISTICS = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


class DataError(ValueError):
    """A CIFAR-10 file is missing or malformed (the message names the file and the fix)."""


def _field(batch: dict, name: str, path: Path) -> object:
    # Python 2 pickled the keys as str, which Python 3 reads back as bytes.
    for key in (name.encode(), name):
        if key in batch:
            return batch[key]
    keys = sorted(k.decode() if isinstance(k, bytes) else str(k) for k in batch)
    raise DataError(f"{path}: no {name!r} entry (it has {keys}); a CIFAR-10 python batch holds "
                    "'data' (N x 3072 uint8) and 'labels' (N ints in 0..9).")


def read_batch(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """The images (uint8, N x 3 x 32 x 32) and labels (int64, N) of one pickled CIFAR-10 batch."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError) as err:
        raise DataError(f"{path}: not a readable pickle ({err}); the file is truncated or not "
                        f"a CIFAR-10 python batch: extract {FOLDER} again from "
                        "cifar-10-python.tar.gz.") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: holds a {type(batch).__name__}, not the dict of a CIFAR-10 "
                        "python batch.")
    data = np.asarray(_field(batch, "data", path))
    labels = np.asarray(_field(batch, "labels", path))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SIDE * SIDE:
        raise DataError(f"{path}: 'data' is {data.dtype} of shape {data.shape}; CIFAR-10 "
                        f"images are uint8 rows of {3 * SIDE * SIDE} values (3 x {SIDE} x {SIDE}).")
    if labels.shape != (data.shape[0],):
        raise DataError(f"{path}: {labels.size} labels for {data.shape[0]} images; each image "
                        "needs one label.")
    if labels.size and (labels.min() < 0 or labels.max() >= len(CLASSES)):
        raise DataError(f"{path}: labels range over {labels.min()}..{labels.max()}; CIFAR-10 "
                        f"has {len(CLASSES)} classes (0..{len(CLASSES) - 1}).")
    images = torch.from_numpy(data.reshape(-1, 3, SIDE, SIDE).copy())
    return images, torch.from_numpy(labels.astype(np.int64))


def cifar_folder(data_dir: str | os.PathLike) -> Path:
    """The folder holding the batches: data_dir itself or its cifar-10-batches-py."""
    data_dir = Path(data_dir)
    nested = data_dir / FOLDER
    return nested if nested.is_dir() else data_dir


def missing_cifar_files(data_dir: str | os.PathLike) -> list[str]:
    """Names of the CIFAR-10 batch files that `cifar_folder(data_dir)` lacks."""
    folder = cifar_folder(data_dir)
    return [name for name in (*TRAIN_FILES, TEST_FILE) if not (folder / name).is_file()]


def read_cifar(data_dir: str | os.PathLike, split: str = "train", *,
               max_items: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10's training (all 5 batches) or test images and labels from data_dir."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    missing = missing_cifar_files(data_dir)
    if missing:
        raise DataError(f"{cifar_folder(data_dir)} lacks {', '.join(missing)}: point --data-dir "
                        f"at the folder extracted from cifar-10-python.tar.gz (the one holding "
                        f"{FOLDER}), or leave --data-dir out to train on generated images.")
    folder = cifar_folder(data_dir)
    parts = [read_batch(folder / name) for name in (TRAIN_FILES if split == "train"
                                                     else (TEST_FILE,))]
    images = torch.cat([images for images, _ in parts])
    labels = torch.cat([labels for _, labels in parts])
    if max_items is not None:
        images, labels = images[:max_items], labels[:max_items]
    return images, labels


def generated_images(items: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`items` uint8 images of CIFAR-10's shape: one smooth pattern per class plus noise.

    Each pattern is mirror-symmetric left to right, so the random horizontal flip of the
    training transform keeps a class's look and the classes stay learnable.
    """
    generator = torch.Generator().manual_seed(seed)
    # The patterns depend only on 0, so training and test sets share them.
    patterns = torch.rand(len(CLASSES), 3, 4, 4, generator=torch.Generator().manual_seed(0))
    patterns = (patterns + patterns.flip(-1)) / 2
    patterns = F.interpolate(patterns, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    labels = torch.randint(0, len(CLASSES), (items,), generator=generator)
    noise = 0.5 * torch.randn(items, 3, SIDE, SIDE, generator=generator)
    pixels = (patterns[labels] + noise).clamp(0.0, 1.0) * 255.0
    return pixels.round().to(torch.uint8), labels


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 (or [0, 255] float) images to (x / 255 - mean) / std per channel, in images' dtype."""
    shape = (-1, 1, 1)
    return (images / 255.0 - mean.view(shape)) / std.view(shape)


def resize(images: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 images N x 3 x H x W resized to side x side (bilinear), still uint8."""
    if images.shape[-1] == side and images.shape[-2] == side:
        return images
    resized = F.interpolate(images.float(), size=(side, side), mode="bilinear",
                            align_corners=False, antialias=True)
    return resized.round().clamp(0, 255).to(torch.uint8)


class CifarImages(Dataset):
    """(image, label) pairs; images flipped at random when training, normalised unless 8-bit.

    `dtype=None` yields the uint8 images themselves (8-bit I/O); a float dtype yields them
    scaled and normalised with `statistics` on the host, in that dtype (as the seed's
    ConvertImageDtype + Normalize transforms do).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, flip: bool,
                 dtype: torch.dtype | None, statistics: dict[str, Sequence[float]] | None = None,
                 ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or len(images) != len(labels):
            raise ValueError(f"CifarImages takes uint8 images N x C x H x W and N labels; got "
                             f"{images.dtype} {tuple(images.shape)} and {len(labels)} labels.")
        self.images, self.labels, self.flip, self.dtype = images, labels, flip, dtype
        statistics = statistics or IMAGENET_STATISTICS
        self.mean = torch.tensor(statistics["mean"])
        self.std = torch.tensor(statistics["std"])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.flip and torch.rand(()) < 0.5:
            image = image.flip(-1)
        if self.dtype is not None:
            image = normalize(image.float(), self.mean, self.std).to(self.dtype)
        return image, self.labels[index]
