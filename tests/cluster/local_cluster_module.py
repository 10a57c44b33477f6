"""cluster/local_cluster.py is a script, not a package module: load it once for the tests."""

from __future__ import annotations

import importlib.util
import sys

from tests import REPO


def load():
    if "local_cluster" in sys.modules:
        return sys.modules["local_cluster"]
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "cluster" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


lc = load()
