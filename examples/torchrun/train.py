"""Data parallel over machines: every machine runs this under torchrun, with 2 replicas each."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import pipetorch as poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 2)

    def forward(self, x, labels):
        out = self.b(torch.relu(self.a(x)))
        return out, F.cross_entropy(out, labels)


opts = poptorch.Options().replicationFactor(2)    # replicas of this process
opts.showCompilationProgressBar(False)
opts.randomSeed(0)        # one shuffled order, dataset and initial weights in every process
dataset = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
loader = poptorch.DataLoader(opts, dataset, batch_size=8, shuffle=True)  # this process's share
net = Net()
model = poptorch.trainingModel(net, opts, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
for x, labels in loader:
    _, loss = model(x, labels)                    # this process's replicas' losses
print(opts.Distributed.processId, "of", opts.Distributed.numProcesses, loss.tolist(),
      float(net.b.weight.detach().sum()))         # the same trained weights in every process
model.destroy()
