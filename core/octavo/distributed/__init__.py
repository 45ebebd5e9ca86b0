"""Tensor parallelism over torch.distributed: the parallel layout, the communicator, the
worker processes and the executor that drives them."""
