"""The test suite; it runs from a checkout, whose root is REPO (the Dockerfile, k8s/, cluster/ live there)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
