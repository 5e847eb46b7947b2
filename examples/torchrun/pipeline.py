"""One pipeline over two machines: stage 0 on process 0's device, stage 1 on process 1's."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import pipetorch as poptorch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)                                  # ipu 0: process 0
        self.b = poptorch.BeginBlock(nn.Linear(64, 4), ipu_id=1)     # ipu 1: process 1

    def forward(self, x, labels):
        out = self.b(torch.relu(self.a(x)))
        return out, F.cross_entropy(out, labels)


opts = poptorch.Options().deviceIterations(2).showCompilationProgressBar(False)
opts.Training.gradientAccumulation(4)
opts.Distributed.stagesAcrossProcesses(True)      # one pipeline over all the processes
opts.randomSeed(0)                                # the same dataset in every process
dataset = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
loader = poptorch.DataLoader(opts, dataset, batch_size=8)  # the same batches on each process
net = Net()
model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1,
                                                                    momentum=0.9))
for x, labels in loader:
    _, loss = model(x, labels)                    # every process gets the loss
print(opts.Distributed.processId, float(loss),
      float(net.b.weight.detach().sum()))         # the trained weights, the same everywhere
model.destroy()
