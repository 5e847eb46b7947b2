"""Hand-written plain-PyTorch loops that pipetorch's results are compared with."""
from __future__ import annotations

import torch
from torch.testing import assert_close


def plain_train_call(model, optimizer, x, y, *, D: int, G: int, R: int, mean: bool = True):
    """One PopTorch host call done by hand: D steps, each accumulating G*R micro-batches.

    Returns a list of (step, replica, output, loss) in [D][G][R] order.
    """
    B = x.shape[0] // (D * G * R)
    results = []
    i = 0
    for d in range(D):
        optimizer.zero_grad()
        for g in range(G):
            for r in range(R):
                xb, yb = x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]
                out, loss = model(xb, yb)
                (loss / (G * R) if mean else loss).backward()
                results.append((d * G + g, r, out.detach(), loss.detach()))
                i += 1
        optimizer.step()
    return results


def expected_outputs(results, mode: str, *, steps: int, R: int, period: int = 1):
    """What PopTorch returns for each OutputMode, from per-micro-batch results."""
    def pick(rows):
        outs = [o for _, _, o, _ in rows]
        losses = [l for _, _, _, l in rows]
        loss = torch.stack(losses) if len(losses) > 1 else losses[0]
        return torch.cat(outs), loss

    if mode == "All":
        return pick(results)
    if mode == "EveryN":
        return pick([row for row in results if row[0] % period == period - 1])
    if mode == "Final":
        return pick([row for row in results if row[0] == steps - 1])
    if mode == "Sum":
        rows = []
        for r in range(R):
            mine = [row for row in results if row[1] == r]
            rows.append((0, r, sum(o for _, _, o, _ in mine), sum(l for _, _, _, l in mine)))
        return pick(rows)
    raise ValueError(mode)


def last_output(staged):
    """The position of a split model's last tensor output (where these tests put the loss)."""
    from pipetorch.partition.split import Source, map_leaves
    leaves = []
    map_leaves(staged.output, Source, leaves.append)
    return len(leaves) - 1


def join(outputs):
    """Micro-batch outputs as OutputMode.All returns them: each leaf's scalars stacked,
    its tensors concatenated along the batch."""
    from torch.utils import _pytree as pytree
    leaves = [pytree.tree_flatten(o)[0] for o in outputs]
    spec = pytree.tree_flatten(outputs[0])[1]
    joined = [torch.stack(col) if col[0].dim() == 0 else torch.cat(col) for col in zip(*leaves)]
    return pytree.tree_unflatten(joined, spec)


def plain_steps(model, optimizer, data):
    """One plain-PyTorch optimiser step per (x, y) batch, on the loss forward returns second."""
    for x, y in data:
        optimizer.zero_grad()
        model(x, y)[1].backward()
        optimizer.step()


def assert_same_weights(got, want):
    """Every parameter of `want` equals the one of the same name in `got`."""
    for name, param in want.named_parameters():
        assert_close(got.get_parameter(name), param, msg=name)


def train_language_model_call(wrapper, plain, plain_optimizer, call: int, G: int, **check):
    """One training call of a wrapped causal language model (labels = inputs) on G random
    sequences of 16 tokens drawn from seed `call`, against plain PyTorch stepping the same
    micro-batches one by one; the call's loss is checked."""
    ids = torch.randint(0, 97, (G, 16), generator=torch.Generator().manual_seed(call))
    got = wrapper(input_ids=ids, labels=ids).loss
    for m in range(G):
        want = plain(input_ids=ids[m:m + 1], labels=ids[m:m + 1]).loss
        (want / G).backward()
    plain_optimizer.step()
    plain_optimizer.zero_grad()
    assert_close(got, want.detach(), **check)
