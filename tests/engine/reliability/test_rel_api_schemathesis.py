"""Hostile HTTP input: schemathesis generates requests from the API's own
OpenAPI document and sends them to a live ApiServer (127.0.0.1) over the
real local engine (the default, paged) on the demo model. No 500s; status codes, content types,
headers and bodies conform to the document."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("openvino")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_url(demo_dir):
    from engine.serve.api import ApiServer, create_app
    from engine.local.factory import EngineOptions, open_engine

    demo_dir("demo")
    # A small context bounds every answer (max_tokens is capped by it): each call stays short.
    engine = open_engine("demo", "local", EngineOptions(extra={"context_length": 256, "max_concurrent": 4}))
    server = ApiServer(create_app(engine)).start()
    yield server.url
    server.stop()
    engine.close()


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


# schemathesis' own pytest plugin does not run under pytest 9 (it reads Function._nodeid):
# its Python API + hypothesis do the same, one operation at a time.
def test_api_conforms_to_its_openapi_document(api_url):
    ops = _operations(api_url)
    assert {f"{op.method.upper()} {op.path}" for op in ops} >= {
        "GET /v1/models", "GET /v1/models/{model}", "POST /v1/chat/completions", "POST /v1/completions"}
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            case.call_and_validate(base_url=api_url, checks=CHECKS, timeout=60)

        check()


def test_a_prompt_longer_than_the_context_is_a_client_error(api_url):
    """Found while fuzzing: it used to be a 500 "engine failed"."""
    import httpx

    r = httpx.post(f"{api_url}/v1/completions", json={"model": "demo", "prompt": "word " * 400}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "context holds 256" in err["message"]
