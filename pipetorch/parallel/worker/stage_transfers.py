"""A stage executor's bundle transfers: over its link to another device's worker, or handed
over in memory between two stages the device holds (parallel.worker.stage)."""
from __future__ import annotations

import torch

from pipetorch.parallel.worker.held import HeldStage
from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, PeerLink, Tag, channel
from pipetorch.schedule.actions import Action, Kind

__all__: list[str] = []


class Transfers:
    """A stage executor's transfers: the stages it holds (`held`, its own dict), the link to
    the other devices (`owners[s]` is stage s's), and the hand-overs between held stages not
    taken yet. `training` is the run's (set by the executor as each run starts)."""

    def __init__(self, held: dict[int, HeldStage], link: PeerLink, owners: tuple[int, ...]) -> None:
        self.held, self.link, self.owners = held, link, owners
        self.handovers: dict[tuple[Tag, int, int], list[torch.Tensor]] = {}
        self.training = False

    def channels(self, actions: list[Action]) -> list[ChannelSpec]:
        """Every direction of traffic with another worker that `actions` use, with its largest
        message (empty bundles, which are never sent, and transfers within this worker left
        out)."""
        carries = {Kind.SEND_ACT: (Tag.ACTIVATIONS, True, "act_out"),
                   Kind.RECV_ACT: (Tag.ACTIVATIONS, False, "act_in"),
                   Kind.SEND_GRAD: (Tag.GRADIENTS, True, "grad_out"),
                   Kind.RECV_GRAD: (Tag.GRADIENTS, False, "grad_in"),
                   Kind.SEND_DONE: (Tag.DONE, True, None), Kind.RECV_DONE: (Tag.DONE, False, None)}
        found: dict[tuple[int, int, bool], int] = {}
        for action in actions:
            if action.kind not in carries or action.peer is None or self._local(action.peer):
                continue
            tag, outgoing, bundle = carries[action.kind]
            layout = getattr(self.held[action.stage], bundle)[1] if bundle else None
            if layout is None or layout.specs:
                sender = action.stage if outgoing else action.peer
                key = (self.owners[action.peer], channel(tag, sender), outgoing)
                found[key] = max(found.get(key, 0), layout.nbytes if layout else 0)
        return [ChannelSpec(peer, tag, outgoing, nbytes)
                for (peer, tag, outgoing), nbytes in sorted(found.items())]

    def _local(self, stage: int | None) -> bool:
        return stage in self.held

    def _transfer_out(self, tag: Tag, action: Action, m: int, layout: BundleLayout,
                      tensors: list[torch.Tensor]) -> None:
        peer = _peer(action)
        if self._local(peer):
            layout.check(tensors)
            self.handovers[(tag, peer, m)] = [t.detach() for t in tensors]
        else:
            self.link.send(layout, tensors, self.owners[peer], channel(tag, action.stage))

    def _transfer_in(self, tag: Tag, action: Action, m: int,
                     layout: BundleLayout) -> list[torch.Tensor]:
        peer = _peer(action)
        if self._local(peer):
            return self.handovers.pop((tag, action.stage, m))
        return self.link.recv(layout, self.owners[peer], channel(tag, peer))

    def recv_act(self, m: int, action: Action) -> None:
        held = self.held[action.stage]
        sources, layout = held.act_in
        tensors = self._transfer_in(Tag.ACTIVATIONS, action, m, layout)
        for spec, tensor in zip(layout.specs, tensors, strict=True):
            if self.training and spec.requires_grad:
                tensor.requires_grad_(True)
        held.received[m] = dict(zip(sources, tensors, strict=True))

    def send_act(self, m: int, action: Action) -> None:
        held = self.held[action.stage]
        forward = held.forwards[m] if self.training else held.forwards.pop(m)
        sources, layout = held.act_out
        self._transfer_out(Tag.ACTIVATIONS, action, m, layout,
                           [forward.values[s] for s in sources])

    def recv_grad(self, m: int, action: Action) -> None:
        held = self.held[action.stage]
        held.grads[m] = self._transfer_in(Tag.GRADIENTS, action, m, held.grad_in[1])

    def send_grad(self, m: int, action: Action) -> None:
        held = self.held[action.stage]
        self._transfer_out(Tag.GRADIENTS, action, m, held.grad_out[1],
                           held.grads_out.pop(m, []))

    def send_done(self, m: int, action: Action) -> None:
        peer = _peer(action)
        if not self._local(peer):  # within the device its list already orders them
            self.link.signal(self.owners[peer], channel(Tag.DONE, action.stage))

    def recv_done(self, m: int, action: Action) -> None:
        peer = _peer(action)
        if not self._local(peer):
            self.link.wait_signal(self.owners[peer], channel(Tag.DONE, peer))


def _peer(action: Action) -> int:
    """The stage a transfer goes to or comes from."""
    assert action.peer is not None, f"{action} is a transfer without a peer"
    return action.peer
