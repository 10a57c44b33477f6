"""Model runners: the runner interface, loading, KV caches, and the forwards that run the models."""
