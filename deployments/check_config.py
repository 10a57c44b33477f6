"""`specserve-check-config FILE...`: validate a Serve config (or a RayService manifest) the way the application
builder does, before it reaches Ray.

Serve builds an application by calling its builder with the config's `args`; when the builder raises (an unknown
key, a value out of range), `serve run` prints the error and tries again without end, and a RayService waits. This
check runs the builder's own validation (`deployments.config.config_from_args`, which `deployments.app.build_app` calls
first) on every specserve application of the file, after Ray's schema of the whole document (`ServeDeploySchema`,
what `serve run` and `serve deploy` read the file with). It starts no Ray and loads no model: it imports the config
model and Ray's schema, nothing else of the application. Files the config names (a calibration profile, a chat
template file) are read from this machine, as the builder reads them where it runs.

A FILE is a Serve config (`applications:` with `import_path` and `args`) or a Kubernetes manifest, one document or
several: each RayService's `spec.serveConfigV2` (a YAML string) is checked, other kinds are passed over. Each
application is reported on a line of its own: `OK`, `SKIP` (another builder's application, whose args are not ours
to check) or `FAIL` with the field's path and pydantic's message. The exit status is 1 when anything failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml
from pydantic import ValidationError

from deployments.config import config_from_args

BUILDER = "deployments.app:build_app"
_BUILDER_DOTTED = BUILDER.replace(":", ".")  # Serve takes "module:attribute" and "module.attribute" alike


def _where(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _shown(value) -> str:
    """An offending input worth quoting: a scalar, not a whole section."""
    return f" (got {value!r})" if isinstance(value, (str, int, float, bool)) or value is None else ""


def errors_of(exc: ValidationError, prefix: str) -> list[str]:
    """One line per pydantic error: the field's path under `prefix` and the message."""
    lines = []
    for err in exc.errors():
        path = _where((prefix, *err["loc"])) if prefix else _where(err["loc"]) or "(document)"
        shown = _shown(err.get("input")) if err["type"] != "extra_forbidden" else ""
        lines.append(f"{path}: {err['msg']}{shown}")
    return lines


def serve_documents(path: Path) -> Iterator[tuple[str, object]]:
    """(where, Serve config document) for every Serve config in the file: the file itself, or the serveConfigV2 of
    each RayService in it. A document that is neither yields a problem (as a string) when the file holds none."""
    found = False
    for doc in yaml.safe_load_all(path.read_text()):
        if isinstance(doc, dict) and doc.get("kind") == "RayService":
            name = (doc.get("metadata") or {}).get("name", "?")
            where = f"{path}: RayService {name}"
            text = (doc.get("spec") or {}).get("serveConfigV2")
            found = True
            if not isinstance(text, str):
                yield where, "spec.serveConfigV2: missing (the Serve config as a YAML string)"
                continue
            try:
                yield f"{where} serveConfigV2", yaml.safe_load(text)
            except yaml.YAMLError as exc:
                yield where, f"spec.serveConfigV2: not YAML: {exc}"
        elif isinstance(doc, dict) and "applications" in doc:
            found = True
            yield str(path), doc
    if not found:
        yield str(path), "neither a Serve config (applications:) nor a RayService manifest"


def check_document(where: str, doc: object) -> list[tuple[str, str]]:
    """(status, line) for one Serve config document: Ray's schema of the whole, then each application's args."""
    from ray.serve.schema import ServeDeploySchema  # Ray's schema only: importing it starts nothing

    results: list[tuple[str, str]] = []
    try:
        ServeDeploySchema.model_validate(doc)
    except ValidationError as exc:
        results += [("FAIL", f"{where}: {line}") for line in errors_of(exc, "")]
    apps = doc.get("applications") if isinstance(doc, dict) else None
    for i, app in enumerate(apps if isinstance(apps, list) else []):
        if not isinstance(app, dict):
            continue  # Ray's schema has said so
        label = f"{where}: application {app.get('name', i)!r}"
        import_path = str(app.get("import_path", ""))
        if import_path.replace(":", ".") != _BUILDER_DOTTED:
            if import_path.split(".")[0].split(":")[0] == "deployments":
                results.append(("FAIL", f"{label}: import_path {import_path!r}: specserve's builder is {BUILDER}"))
            else:
                results.append(("SKIP", f"{label}: import_path {import_path!r} is not {BUILDER}; args not checked"))
            continue
        try:
            config_from_args(app.get("args"))
        except ValidationError as exc:
            results += [("FAIL", f"{label}: {line}") for line in errors_of(exc, "args")]
        else:
            results.append(("OK", label))
    return results


def check_file(path: str | Path) -> list[tuple[str, str]]:
    """(status, line) for every application in a Serve config or manifest file."""
    path = Path(path)
    try:
        documents = list(serve_documents(path))
    except (OSError, yaml.YAMLError) as exc:
        return [("FAIL", f"{path}: {exc}")]
    results = []
    for where, doc in documents:
        results += [("FAIL", f"{where}: {doc}")] if isinstance(doc, str) else check_document(where, doc)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve-check-config", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="FILE", help="serve_config.yaml, or a RayService manifest")
    args = parser.parse_args(argv)
    failed = False
    for file in args.files:
        for status, line in check_file(file):
            failed |= status == "FAIL"
            print(f"{status:4} {line}", file=sys.stderr if status == "FAIL" else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
