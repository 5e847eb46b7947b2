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
from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

__all__: list[str] = []


@dataclass
class Group:
    """Weights whose subgraphs join the input path at the same nodes (intermediates)."""

    params: dict[Node, torch.nn.Parameter]  # each weight's gradient accumulator
    intermediates: list[Node]


@dataclass
class Deferred:
    """What B leaves for W: the groups of weights and the grads B saw at the intermediates."""

    groups: list[Group]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)

    @property
    def intermediates(self) -> list[Node]:
        return [node for group in self.groups for node in group.intermediates]


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
    for leaf, grad in zip(wanted, grads, strict=True):
        if grad is not None:
            leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    return deferred


def backward_weight(deferred: Deferred | None) -> None:
    """The weights' gradients from the intermediates' recorded grads, added to `.grad`.

    One autograd call per group: a call starting at a Linear's intermediate would otherwise
    run down the input path again to reach a lower layer's weight.
    """
    if deferred is None:
        return
    for group in deferred.groups:
        recorded = {node: deferred.grads[node] for node in group.intermediates
                    if node in deferred.grads}
        edges, seeds = [], []
        for node, grads in recorded.items():
            for n, grad in enumerate(grads):
                if grad is not None:
                    edges.append(GradientEdge(node, n))
                    seeds.append(grad)
        if not edges:
            continue
        # An intermediate below another of the group would get its grad twice (its recorded
        # one, and again through the upper one): pin its incoming grad to what B recorded.
        handles = [node.register_prehook(lambda _, saved=grads: saved)
                   for node, grads in recorded.items()] if len(recorded) > 1 else []
        try:
            found = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in group.params],
                                        seeds, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for node, grad in zip(group.params, found, strict=True):
            if grad is not None:
                param = group.params[node]
                param.grad = grad if param.grad is None else param.grad + grad


def _recorder(deferred: Deferred, node: Node
              ) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        deferred.grads[node] = tuple(grad_outputs)
    return record


def _node(tensor: torch.Tensor) -> Node:
    """The tensor's grad_fn, or a leaf's gradient accumulator (made through a view)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    node = tensor.view_as(tensor).grad_fn
    accumulator = node.next_functions[0][0] if node is not None else None
    assert accumulator is not None, "a tensor that requires grad has a grad_fn or an accumulator"
    return accumulator


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
    groups: list[Group] = []  # weights sharing an intermediate share a group
    for node, param in nodes.items():
        if node not in seen:
            continue  # not used by this micro-batch's forward
        met = _closure([node], users, stop=on_input_path) & on_input_path
        if not met:
            return None  # this weight's gradient never meets the input path
        joined = [g for g in groups if met & set(g.intermediates)]
        group = Group({node: param}, list(met))
        for other in joined:
            groups.remove(other)
            group.params.update(other.params)
            group.intermediates += [n for n in other.intermediates if n not in met]
        groups.append(group)
    return Deferred(groups) if groups else None


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
