"""Issue 54: a buffer forward changes inside `with torch.no_grad():` is a changed buffer too
(torch.export puts that block in a subgraph), so replicas sharing it get PopTorch's error."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch
from pipetorch.partition import probe


class CountsBias(nn.Module):
    """PopTorch's BufferUpdatingModel: a buffer summing a bias under no_grad."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("total", torch.zeros(2))

    def forward(self, x, y):
        out = self.lin(x)
        with torch.no_grad():
            self.total += self.lin.bias
        return out, F.l1_loss(out, y)


def test_the_export_capture_finds_a_buffer_changed_under_no_grad():
    # written_attributes looked only at the top graph, not inside wrap_with_set_grad_enabled
    found, _ = probe.probe_by_export(CountsBias(), (torch.ones(2, 3), torch.zeros(2, 2)), {},
                                     training=True)
    assert found.mutated_buffers == ["total"]


def test_replicas_broadcasting_a_buffer_changed_under_no_grad_get_poptorchs_error():
    # pipetorch trained on silently, each replica with its own diverging copy of the buffer
    model = CountsBias()
    opts = poptorch.Options().replicationFactor(2)
    wrapped = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(),
                                                                            lr=0.1))
    with pytest.raises(poptorch.Error, match=r"PopTorch does not support broadcasting buffers\. "
                                             r".*broadcastBuffers\(False\)"):
        wrapped(torch.ones(4, 3), torch.zeros(4, 2))
    wrapped.destroy()
