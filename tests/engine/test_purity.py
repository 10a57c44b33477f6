"""engine/ is importable without Ray (DESIGN.md convention 1)."""

import subprocess
import sys


def test_engine_imports_without_ray():
    code = "import sys, engine, engine.cli; assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))"
    subprocess.run([sys.executable, "-c", code], check=True)
