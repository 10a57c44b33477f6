"""engine/ never imports Ray (docs/ARCHITECTURE.md): every module of the package, imported in a fresh
interpreter, leaves `ray` out of sys.modules. The engine runs in-process (CLI, benchmarks) with no cluster."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import engine

# imports each module named on the command line, then fails naming any ray module that came with them
CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
assert not leaked, leaked[:10]
"""


def engine_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(engine.__path__, prefix="engine."))


def imports_without_ray(modules: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK, *modules], capture_output=True, text=True)


def test_every_engine_module_imports_without_ray():
    modules = engine_modules()
    root = Path(engine.__file__).parent
    on_disk = {"engine." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for p in root.rglob("*.py") if p.name != "__init__.py" or p.parent != root}
    assert on_disk <= set(modules), on_disk - set(modules)
    result = imports_without_ray(["engine", *modules])
    assert result.returncode == 0, result.stderr


def test_the_check_fails_for_a_module_that_imports_ray():
    result = imports_without_ray(["engine", "deployments.router.leases"])  # imports ray.exceptions
    assert result.returncode != 0 and "ray" in result.stderr


def test_the_round_maths_never_imports_the_models_or_the_proposers():
    """engine/spec/ (plan, policy, accept, rejection, randomness) is the maths: it may use the request's state and
    sampling, never a model, a runner, a proposer or the factory (read from the source: importing any engine module
    runs engine/__init__.py, which imports them all)."""
    import ast

    root = Path(engine.__file__).parent
    forbidden = ("engine.models", "engine.proposers", "engine.factory", "engine.speculative", "engine.calibration")
    found = {}
    for path in (root / "spec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.startswith(forbidden)]
            if bad:
                found[path.name] = bad
    assert not found, found
    assert len(list((root / "spec").glob("*.py"))) >= 7  # the check read the package
