"""Model execution: config, loading, the persistent input batch and the model runner."""
