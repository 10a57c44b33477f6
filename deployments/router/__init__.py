"""The router: admits requests, leases Draft/Target replicas, and runs the speculative rounds."""
