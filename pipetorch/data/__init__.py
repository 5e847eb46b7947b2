"""Data loading: PopTorch's DataLoader (combined batches) and the asynchronous loader process."""
from pipetorch.data.accessor import AsynchronousDataAccessor
from pipetorch.data.fetch import LoaderStats
from pipetorch.data.loader import DataLoader
from pipetorch import torch_compat

torch_compat.restore()  # PopTorch-era samplers call Sampler.__init__(data_source)

__all__ = ["AsynchronousDataAccessor", "DataLoader", "LoaderStats"]
