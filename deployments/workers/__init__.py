"""The model workers (draft, target) and the Serve deployments that own and lease them."""
