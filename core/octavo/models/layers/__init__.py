"""Model building blocks that call the platform's resolved kernels and can be sharded for TP."""
