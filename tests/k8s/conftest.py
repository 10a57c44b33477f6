"""The committed manifests under k8s/ (not the overlays, not the schemas), loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from k8s.overlay import load_overlay, overlays
from tests import REPO

from .checks import load_all

K8S = REPO / "k8s"
OVERLAYS = overlays(REPO)


def manifest_files() -> list[Path]:
    skip = {K8S / "overlays", K8S / "schemas"}
    return sorted(p for p in K8S.rglob("*.yaml") if not any(s in p.parents for s in skip))


def manifests() -> list[tuple[str, dict]]:
    return [(str(p.relative_to(REPO)), doc) for p in manifest_files() for doc in load_all(p)]


def rayservices() -> list[tuple[str, dict]]:
    """(overlay name, RayService) for each overlay, read from the committed file the overlay generates."""
    out = []
    for overlay in OVERLAYS:
        ov = load_overlay(overlay)
        docs = load_all(REPO / ov.output_dir / "rayservice.yaml")
        out.append((overlay.stem, docs[0]))
    return out


@pytest.fixture(params=[p.stem for p in OVERLAYS])
def overlay_case(request):
    """(overlay, committed RayService) per overlay."""
    path = next(p for p in OVERLAYS if p.stem == request.param)
    ov = load_overlay(path)
    return ov, load_all(REPO / ov.output_dir / "rayservice.yaml")[0]
