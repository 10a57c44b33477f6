"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis), against a real HTTP server.

The app runs under uvicorn in a thread with the tiny models. Over 1,000 generated cases (valid and invalid
requests): no 5xx, no hang (each call has a timeout), and the server still answers a normal request afterwards.
"""

from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from deployments.router.router import Router
from tests.deployments.conftest import TINY_CHAT_TEMPLATE, LocalBroker, http_server, tiny_config

CASES_PER_OPERATION = 150  # per operation and mode (valid / invalid bodies): 4 POST operations x 2 modes >= 1,000


@dataclass
class FuzzRun:
    cases: int = 0  # requests sent
    failures: list[str] = field(default_factory=list)  # per operation and mode, hypothesis' (shrunk) failing case


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs, limits={"max_tokens": 16})
    router = Router(config, LocalBroker(config))
    # a template that reads tools, so fuzzed tools and tool choices reach planning, their grammars and parsing
    router.tokenizer.chat_template = TINY_CHAT_TEMPLATE + "{% if tools %}w7 {% endif %}"
    with http_server(router) as base:
        yield base, router


@pytest.fixture(scope="module")
def fuzzed(server) -> FuzzRun:
    """Every operation fuzzed once per module, whichever of the tests below runs first (or alone)."""
    base, _ = server
    run = FuzzRun()
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {("POST", "/v1/completions"),
                                                                  ("POST", "/v1/chat/completions")}
    # invalid requests need something to break: only operations with a body get the negative mode
    plan = [(op, mode) for op in operations for mode in GenerationMode
            if mode == GenerationMode.POSITIVE or op.method.upper() == "POST"]
    for operation, mode in plan:
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            run.cases += 1
            response = case.call(timeout=30)
            assert response.status_code < 500, (case.method, case.path, case.body, response.status_code,
                                                response.text[:500])
            if response.status_code >= 400 and case.path.startswith("/v1"):
                error = response.json()["error"]  # OpenAI's error JSON
                assert error["message"] and error["type"]

        try:
            check()
        except Exception as exc:  # hypothesis re-raises the shrunk failing case once it is done
            run.failures.append(f"{operation.method.upper()} {operation.path} ({mode.name}): {exc!r}")
    return run


def test_no_server_errors(fuzzed):
    assert not fuzzed.failures, "\n".join(fuzzed.failures)
    assert fuzzed.cases >= 1000, f"only {fuzzed.cases} fuzz cases ran"


def test_after_fuzzing_a_normal_request_still_works(server, fuzzed):
    base, router = server
    assert fuzzed.cases > 0
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert router.scheduler.num_live == 0, "no request left behind in the round loop"
