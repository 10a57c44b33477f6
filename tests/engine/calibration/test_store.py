"""Start-up costs kept on disk: measured once per key, read back after, measured again when anything in the key
changes or the file is unreadable; never kept without a directory."""

import json
from pathlib import Path

import torch

from engine.calibration.store import cached_costs, costs_key, model_key
from engine.models.static.runner import KVBudget, StaticRunner
from tests.conftest import make_tiny_model


class Measure:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"verify_seconds": [[0.01 * self.calls]]}


def test_measured_once_per_key_then_read_back(tmp_path):
    measure = Measure()
    first = cached_costs(str(tmp_path), {"role": "target", "n": 1}, measure)
    again = cached_costs(str(tmp_path), {"role": "target", "n": 1}, measure)
    other = cached_costs(str(tmp_path), {"role": "target", "n": 2}, measure)
    assert measure.calls == 2 and first == again == {"verify_seconds": [[0.01]]} and other != first


def test_an_unreadable_entry_is_measured_again_and_replaced(tmp_path):
    measure = Measure()
    cached_costs(str(tmp_path), {"k": 1}, measure)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    assert cached_costs(str(tmp_path), {"k": 1}, measure) == {"verify_seconds": [[0.02]]}
    assert json.loads(entry.read_text())["costs"] == {"verify_seconds": [[0.02]]}
    assert cached_costs(str(tmp_path), {"k": 1}, measure) == {"verify_seconds": [[0.02]]} and measure.calls == 2


def test_no_directory_always_measures_and_an_unwritable_one_still_answers(tmp_path):
    measure = Measure()
    cached_costs(None, {"k": 1}, measure)
    cached_costs(None, {"k": 1}, measure)
    assert measure.calls == 2
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be: nothing can be written under it
    assert cached_costs(str(blocked / "costs"), {"k": 1}, measure) == {"verify_seconds": [[0.03]]}


def test_the_key_changes_with_the_models_files_the_runner_and_its_settings(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"12345")
    before = model_key(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"123456")
    assert model_key(model_dir) != before
    model = make_tiny_model("llama", seed=0)
    small = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=2), compile=False)
    large = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=4), compile=False)
    key = costs_key("target", model_dir, "float32", small, max_k=3)
    assert key == costs_key("target", model_dir, "float32", small, max_k=3)
    assert key != costs_key("target", model_dir, "float32", small, max_k=2)
    assert key != costs_key("target", model_dir, "float32", large, max_k=3)
    assert key != costs_key("draft", model_dir, "int8", small, max_k=3)
    assert key["hardware"]["threads"] >= 1 and key["hardware"]["torch"]


def test_the_key_names_the_cpu_operators_steps_run_on(monkeypatch):
    """Costs measured on ATen's operators are not reused once specserve's CPU operators run the steps, or after
    their sources change (engine/models/cpu/extension.py)."""
    from engine.calibration import store
    from engine.models.cpu import extension as cpu_extension

    with_ops = store.hardware_key(torch.device("cpu"))
    monkeypatch.setattr(cpu_extension, "_namespace", lambda: None)
    assert store.hardware_key(torch.device("cpu"))["cpu_ops"] == "aten"
    if with_ops["cpu_ops"] != "aten":  # x86 with AVX2 and g++ (this project's machines)
        assert with_ops["cpu_ops"].startswith("specserve_ops-")
        monkeypatch.setattr(cpu_extension, "_namespace", lambda: object())
        monkeypatch.setattr(cpu_extension, "SOURCES", [*cpu_extension.SOURCES, Path(cpu_extension.__file__)])
        assert store.hardware_key(torch.device("cpu"))["cpu_ops"] != with_ops["cpu_ops"]
