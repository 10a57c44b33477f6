"""Fixtures shared with the deployment tests."""

from tests.deployments.conftest import tiny_model_dirs  # noqa: F401 (a fixture, re-exported)
