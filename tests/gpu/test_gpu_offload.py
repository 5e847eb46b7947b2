"""Offloaded optimiser state on a GPU: the device memory it frees, measured by the allocator."""
import torch
import torch.nn as nn

from gpu_cases import CUDA
from pipetorch.optim.offload import offload_state

pytestmark = CUDA

WIDTH, ROWS = 512, 8192  # activations (ROWS x WIDTH) dwarf the weights and Adam's moments


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)).cuda()
    x = torch.randn(ROWS, WIDTH, device="cuda")
    return model, x


def step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as in both runs
    model(x).square().mean().backward()
    optimizer.step()


def state_bytes(optimizer):
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor) and v.dim())


def measure(offloaded):
    """(bytes allocated between steps, peak bytes of the second step, state bytes, weights).

    Everything it allocated on the GPU is gone when it returns, so two runs start alike."""
    model, x = model_and_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if offloaded:
        offload_state(optimizer)
    step(model, optimizer, x)  # creates the state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    between = torch.cuda.memory_allocated()
    step(model, optimizer, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    size = state_bytes(optimizer)
    weights = {n: v.cpu() for n, v in model.state_dict().items()}
    return between, peak, size, weights


def test_offload_frees_the_optimiser_states_device_memory_and_keeps_the_numbers():
    on_device, on_device_peak, size, plain = measure(offloaded=False)
    off, off_peak, off_size, weights = measure(offloaded=True)
    assert size == off_size == 2 * sum(v.numel() * 4 for v in plain.values())
    # Between steps the device holds no optimiser state at all...
    assert on_device - off == size
    # ...and while forward and backward (the peak) run, it is still in host memory.
    assert on_device_peak - off_peak >= size
    for name, value in plain.items():  # bit for bit: the same update, only elsewhere
        assert torch.equal(weights[name], value), name
