"""A stage's backward in two parts: its input's gradient now (B), its weights' later (W).

The zero-bubble schedules send a stage's input gradient upstream as soon as it is known and
compute the weights' gradients later, in what would be idle time. Running autograd twice from
the outputs would do the input path's work twice, so B (as torch.distributed.pipelining's
`stage_backward_input` does) records the gradient flowing into each node where a weight's
subgraph joins the input path (an *intermediate*), and W starts from those nodes only:

    loss <- ... <- matmul <- ... <- received input      B: this path, hooks on `matmul`
                     ^
                     weight                              W: from `matmul` to the weight

When nothing can be split (no input to differentiate, or a weight whose gradient never meets
the input path), B runs the whole backward and W has nothing left to do.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__: list[str] = []


@dataclass
class Deferred:
    """What B leaves for W: the weights' gradient nodes and the grads seen at the
    intermediates."""

    params: dict[Node, torch.nn.Parameter]
    intermediates: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


def backward_input(tensors: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None],
                   leaves: Sequence[torch.Tensor],
                   params: Sequence[torch.nn.Parameter]) -> Deferred | None:
    """Back-propagate `seeds` from `tensors` into `leaves` only (added to their `.grad`), and
    return what W needs; or run the whole backward and return None when it cannot split."""
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    deferred = _plan(roots, wanted, params) if roots and wanted else None
    if deferred is None:
        torch.autograd.backward(list(tensors), list(seeds))
        return None
    handles = [node.register_prehook(_recorder(deferred, node))
               for node in deferred.intermediates]
    try:
        grads = torch.autograd.grad(list(tensors), wanted, list(seeds), retain_graph=True,
                                    allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for leaf, grad in zip(wanted, grads):
        if grad is not None:
            leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    return deferred


def backward_weight(deferred: Deferred | None) -> None:
    """The weights' gradients from the intermediates' recorded grads, added to `.grad`; frees
    the graph."""
    if deferred is None or not deferred.grads:
        return
    edges, seeds = [], []
    for node, grads in deferred.grads.items():
        for n, grad in enumerate(grads):
            if grad is not None:
                edges.append(GradientEdge(node, n))
                seeds.append(grad)
    params = list(deferred.params)
    # An intermediate below another would get its grad twice (its recorded one, and again
    # through the upper one): pin each intermediate's incoming grad to what B recorded.
    handles = [node.register_prehook(lambda _, saved=grads: saved)
               for node, grads in deferred.grads.items()] if len(deferred.grads) > 1 else []
    try:
        found = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in params], seeds,
                                    allow_unused=True) if edges else ()
    finally:
        for handle in handles:
            handle.remove()
    for node, grad in zip(params, found):
        if grad is not None:
            param = deferred.params[node]
            param.grad = grad if param.grad is None else param.grad + grad


def _recorder(deferred: Deferred, node: Node):  # type: ignore[no-untyped-def]
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        deferred.grads[node] = tuple(grad_outputs)
    return record


def _node(tensor: torch.Tensor) -> Node:
    """The tensor's grad_fn, or a leaf's gradient accumulator (made through a view)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    node = tensor.view_as(tensor).grad_fn
    assert node is not None, "a tensor that requires grad has a grad_fn or an accumulator"
    return node.next_functions[0][0]


def _plan(roots: list[Node], leaves: list[torch.Tensor],
          params: Sequence[torch.nn.Parameter]) -> Deferred | None:
    """The intermediates of every weight in the graph, or None if one has none."""
    users: dict[Node, list[Node]] = collections.defaultdict(list)  # node -> nodes using it
    seen, queue = set(roots), collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                users[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    on_input_path = _closure([_node(leaf) for leaf in leaves], users, stop=set())
    nodes = {_node(p): p for p in params if p.requires_grad}
    nodes = {node: p for node, p in nodes.items() if node in seen}
    intermediates: set[Node] = set()
    for node in nodes:
        met = _closure([node], users, stop=on_input_path) & on_input_path
        if not met:
            return None  # this weight's gradient never meets the input path
        intermediates |= met
    return Deferred(nodes, sorted(intermediates, key=id)) if nodes else None


def _closure(starts: list[Node], users: dict[Node, list[Node]], *, stop: set[Node]) -> set[Node]:
    """`starts` and every node that uses them, transitively; a node in `stop` is included but
    not followed."""
    found, queue = set(starts), collections.deque(starts)
    while queue:
        for user in users.get(queue.popleft(), []):
            if user not in found:
                found.add(user)
                if user not in stop:
                    queue.append(user)
    return found
