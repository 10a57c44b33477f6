"""`specserve-check-config` (deployments/check_config.py): a config that does not validate stops before Ray starts,
with the field named and a non-zero status, and `make run` checks first."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.check_config import main

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIG = ROOT / "serve_config.yaml"
KIND_RAYSERVICE = ROOT / "k8s" / "kind" / "rayservice.yaml"


def serve_config_with(tmp_path, change, name="serve_config.yaml") -> Path:
    """serve_config.yaml with `change(args)` applied to its application's args, written to tmp_path."""
    doc = yaml.safe_load(SERVE_CONFIG.read_text())
    change(doc["applications"][0]["args"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_shipped_serve_config_passes(capsys):
    assert main([str(SERVE_CONFIG)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"OK   {SERVE_CONFIG}: application 'specserve'"] and err == ""


def test_an_unknown_key_fails_naming_the_key(tmp_path, capsys):
    path = serve_config_with(tmp_path, lambda args: args["model"].update(colour="red"))
    assert main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert "args.model.colour: Extra inputs are not permitted" in err and err.startswith("FAIL") and "OK" not in out


@pytest.mark.parametrize("change, field, message", [
    (lambda args: args["speculation"].update(num_speculative_tokens=99), "args.speculation.num_speculative_tokens",
     "less than or equal to 16 (got 99)"),
    (lambda args: args["runner"].update(kind="fastest"), "args.runner.kind", "'auto', 'static' or 'transformers'"),
    (lambda args: args["speculation"].update(ngram_min=5), "args", "ngram_min must be <= ngram_max"),  # across fields
])
def test_a_bad_value_fails_naming_the_field(tmp_path, capsys, change, field, message):
    path = serve_config_with(tmp_path, change)
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert f"application 'specserve': {field}: " in err and message in err, err


def test_the_check_fails_where_the_application_builder_fails(tmp_path, capsys):
    """The check and `build_app` validate with one function: the builder refuses the same args with the same errors."""
    from deployments.app import build_app

    path = serve_config_with(tmp_path, lambda args: args.update(limits={"max_choices": 0, "frobnicate": 1}))
    assert main([str(path)]) == 1
    reported = capsys.readouterr().err
    with pytest.raises(ValidationError) as refused:
        build_app(yaml.safe_load(path.read_text())["applications"][0]["args"])
    errors = refused.value.errors()
    assert {e["loc"] for e in errors} == {("limits", "max_choices"), ("limits", "frobnicate")}
    for e in errors:
        assert f"args.{'.'.join(e['loc'])}: {e['msg']}" in reported


def test_rayservice_manifests_are_checked_through_their_serve_config(tmp_path, capsys):
    assert main([str(KIND_RAYSERVICE), str(ROOT / "k8s" / "prod" / "rayservice.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.count("serveConfigV2: application 'specserve'") == 2 and out.count("OK") == 2
    manifest = yaml.safe_load(KIND_RAYSERVICE.read_text())
    serve_doc = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    serve_doc["applications"][0]["args"]["tp_size"] = 0
    bad = copy.deepcopy(manifest)
    bad["spec"]["serveConfigV2"] = yaml.safe_dump(serve_doc)
    ingress = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "x"}}
    path = tmp_path / "rayservice.yaml"
    path.write_text(yaml.safe_dump_all([ingress, bad]))  # other kinds in the file are passed over
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "RayService specserve serveConfigV2: application 'specserve': args.tp_size: " in err


def test_rays_own_schema_and_other_builders(tmp_path, capsys):
    doc = yaml.safe_load(SERVE_CONFIG.read_text())
    other = {"name": "other", "route_prefix": "/other", "import_path": "my_pkg.app:app", "args": {"anything": 1}}
    doc["applications"].append(other)
    path = tmp_path / "two_apps.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main([str(path)]) == 0, "another builder's args are not ours to check"
    assert "SKIP" in capsys.readouterr().out
    doc["applications"][0]["import_path"] = "deployments.app:buildapp"  # a typo Serve would retry without end
    del doc["applications"][1]["import_path"]
    path.write_text(yaml.safe_dump(doc))
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "specserve's builder is deployments.app:build_app" in err
    assert "applications.1.import_path: Field required" in err, "Ray's schema of the whole document"
    (tmp_path / "empty.yaml").write_text("kind: ConfigMap\n")
    assert main([str(tmp_path / "empty.yaml")]) == 1


def test_the_command_exits_non_zero_without_starting_ray(tmp_path):
    path = serve_config_with(tmp_path, lambda args: args["router"].update(max_replicas="many"))
    probe = ("import runpy, sys\nsys.argv = ['specserve-check-config', sys.argv[1]]\n"
             "try:\n    runpy.run_module('deployments.check_config', run_name='__main__')\n"
             "except SystemExit as exit:\n    import ray\n    print('ray started:', ray.is_initialized())\n"
             "    raise\n")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "args.router.max_replicas: Input should be a valid integer" in done.stderr
    assert "ray started: False" in done.stdout


def test_make_run_checks_the_config_before_serve_starts():
    dry = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    check = [i for i, line in enumerate(lines) if "-m deployments.check_config serve_config.yaml" in line]
    serve = [i for i, line in enumerate(lines) if "serve run serve_config.yaml" in line]
    assert check and serve and check[0] < serve[0], dry.stdout
    makefile = (ROOT / "Makefile").read_text()
    assert "\t-$(BIN)/python -m deployments.check_config" not in makefile, "a failed check must stop make"
