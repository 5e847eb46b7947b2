"""torch's common failures told in the user's terms: which kind a message reports (dtype,
shape, target out of range, not a tensor), the fix for each, and the user's line in a
traceback (a host's exception or a worker's formatted text)."""
from __future__ import annotations

import contextlib
import os
import re
import sysconfig
import traceback
from typing import Sequence

import torch

__all__: list[str] = []

# (kind, pattern of torch's message): the first kind whose pattern the message holds.
_KINDS = (
    ("not_tensor", re.compile(r"must be Tensor, not|expected Tensor as element")),
    ("dtype", re.compile(r"must have the same dtype|expected scalar type|Input type \(|"
                         r"expected both vectors to have same dtype|found dtype|"
                         r"have the same dtype")),
    ("target", re.compile(r"Target -?\d+ is out of bounds|n_classes|cur_target")),
    ("shape", re.compile(r"shapes cannot be multiplied|size mismatch|must match the size|"
                         r"channels, but got|The size of tensor|Expected input batch_size|"
                         r"but got input of size|normalized_shape|Target size")),
)
_LIBRARY = tuple(os.path.dirname(f) + os.sep for f in (torch.__file__, contextlib.__file__))
_PIPETORCH = os.path.dirname(__file__) + os.sep
_SITE = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
_FRAME = re.compile(r'^[ \t]*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$'
                    r'(?:\n(?![ \t]*File ")(?P<code>[ \t]+\S.*))?', re.MULTILINE)

HINTS = {
    "dtype": "Convert the input to the model's dtype before the call or in the dataset",
    "target": ("Class labels (targets) must be in [0, C) for a model with C outputs: check the "
               "dataset's labels against the model's output size"),
    "shape": ("A layer was built for other sizes than the data has: check the inputs' sizes "
              "after dim 0 against the model's layers"),
    "not_tensor": "Pass tensors: torch.tensor(values), or torch.stack(a list of tensors)",
}


def error_kind(message: str) -> str | None:
    """Which common failure torch's `message` reports: not_tensor, dtype, target, shape."""
    return next((kind for kind, pattern in _KINDS if pattern.search(message)), None)


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<") or filename.startswith(_PIPETORCH):
        return False
    if filename.startswith(_SITE):  # installed model code (transformers) is the user's
        return not filename.startswith(os.path.dirname(torch.__file__))
    return not filename.startswith(_LIBRARY)


Frame = tuple[str, int, str, "str | None"]  # file, line, function, code


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost (file, line, function, code) frame of the user's code, or None."""
    return next((f for f in reversed(frames) if _is_user_file(f[0])), None)


def frames_in(text: str) -> list[Frame]:
    """The frames of a formatted traceback or stack trace (a worker's, a graph node's)."""
    return [(m["file"], int(m["line"]), m["name"], m["code"]) for m in _FRAME.finditer(text)]


def user_line(frames: Sequence[Frame]) -> str | None:
    """"model.py:12 in forward: return self.fc(x)" for the innermost (file, line, function,
    code) frame of the user's code."""
    frame = user_frame(frames)
    if frame is None:
        return None
    filename, line, name, code = frame
    return f"{filename}:{line} in {name}" + (f": {code.strip()}" if code else "")


def user_line_of(error: BaseException) -> str | None:
    """The innermost line of the user's code in `error`'s traceback."""
    return user_line([(f.filename, f.lineno or 0, f.name, f.line)
                      for f in traceback.extract_tb(error.__traceback__)])


def user_line_in(text: str) -> str | None:
    """The innermost line of the user's code in a formatted traceback (a worker's)."""
    return user_line(frames_in(text))
