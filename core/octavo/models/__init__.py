"""Model architectures of the core."""
