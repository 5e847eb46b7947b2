"""`poptorch.module_repr`: a module printed with its forward pre-hooks (where BeginBlock lives)."""
from __future__ import annotations

import torch.nn as nn

__all__ = ["module_repr"]


def _indent(text: str) -> str:
    return "\n  ".join(text.split("\n"))


def module_repr(module: nn.Module) -> str:
    """`repr(module)` with each module's pre-hooks in front, so BeginBlock annotations show.

    >>> poptorch.BeginBlock(model.fc, ipu_id=1)
    >>> print(poptorch.module_repr(model))  # (fc): BeginBlock(user_id=None, ipu_id=1) Linear(..
    """
    extra = module.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    child_lines = [f"({name}): {_indent(module_repr(child))}"
                   for name, child in module._modules.items() if child is not None]
    hooks = "".join(f"{hook!r} " for hook in module._forward_pre_hooks.values()
                    if type(hook).__repr__ is not object.__repr__)
    text = f"{hooks}{module._get_name()}("
    if len(extra_lines) == 1 and not child_lines:
        text += extra_lines[0]
    elif extra_lines or child_lines:
        text += "\n  " + "\n  ".join(extra_lines + child_lines) + "\n"
    return text + ")"
