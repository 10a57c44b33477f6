"""The Dockerfile, read statically (no Docker daemon here): its pins agree with what the tests run, it installs
every package of the project, and nothing that looks like model weights can reach the image."""

from __future__ import annotations

import fnmatch
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from k8s.overlay import load_overlay, overlays
from tests import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def _arg_defaults() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", DOCKERFILE, flags=re.MULTILINE))


def _ignored() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def test_base_image_is_rays_at_the_tested_version():
    import ray

    args = _arg_defaults()
    assert args["RAY_VERSION"] == ray.__version__
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{PYTHON_TAG\}-\$\{VARIANT\}$", DOCKERFILE, re.MULTILINE)
    assert args["VARIANT"] == "gpu" and re.fullmatch(r"py3\d+", args["PYTHON_TAG"])
    assert '"ray[serve]==${RAY_VERSION}"' in DOCKERFILE
    for overlay in overlays(REPO):
        assert load_overlay(overlay).ray_version == args["RAY_VERSION"]


def test_torch_pin_is_the_makefiles():
    make = (REPO / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", make, re.MULTILINE).group(1)
    assert _arg_defaults()["TORCH_VERSION"] == spec
    assert "--index-url" in DOCKERFILE and 'if [ "$VARIANT" = "cpu" ]' in DOCKERFILE


def test_every_package_and_file_the_install_needs_is_copied_and_not_ignored():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    copied = set()
    for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", DOCKERFILE, flags=re.MULTILINE):
        copied.update(line.split()[:-1])
    top_level = {name.split(".")[0] for name in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = top_level | {"pyproject.toml", project["project"]["readme"]}
    assert needed <= copied, needed - copied
    for name in copied:
        assert (REPO / name).exists(), name
        assert not any(fnmatch.fnmatch(name, pattern) for pattern in _ignored()), f"{name} is .dockerignored"


def test_no_weights_in_the_build_context():
    ignored = _ignored()
    for pattern in ("*.gguf", "*.safetensors", "models", ".venv", ".git"):
        assert pattern in ignored
    assert "HF_HUB_OFFLINE=1" in DOCKERFILE


def test_cpu_variant_is_what_the_kind_overlay_runs():
    kind = load_overlay(REPO / "k8s/overlays/kind.yaml")
    assert kind.image == "specserve:cpu"
    assert "docker build --build-arg VARIANT=cpu -t specserve:cpu ." in DOCKERFILE
    assert "--build-arg VARIANT=cpu" in (REPO / "DEPLOY.md").read_text()
