"""``/api/elastic/*`` from its OpenAPI description: in sync with the routes, and never a 5xx.

Hypothesis drives a real server (the module's ``plain_server``) with what the description
allows and what it does not: any kernel id (unknown, malformed, encoded), any method, JSON
bodies of any shape, bytes that are not JSON, stray query parameters. Every answer must be
below 500, and every error a JSON object with a ``message``.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernelmgr.server.handlers import elastic_handlers
from tests.support.server import TOKEN, RunningServer

pytestmark = pytest.mark.pure

SPEC = yaml.safe_load((Path(__file__).resolve().parents[1] / "docs" / "openapi.yaml").read_text())
PATHS: dict[str, dict[str, Any]] = SPEC["paths"]
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
kernel_ids = st.one_of(
    st.uuids().map(str),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40),
    st.sampled_from(["..", "%2e%2e", "a" * 300, "-", "_"]),
)


def raw(server: RunningServer, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + path, data=body, method=method)
    request.add_header("Authorization", f"token {TOKEN}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def check(status: int, payload: bytes, what: str) -> None:
    assert status < 500, f"{what}: {status} {payload[:300]!r}"
    # A path no route matches (an id with characters no kernel id has) gets jupyter_server's
    # HTML 404 page; every other error is ours or an API handler's, as JSON with a message.
    if status >= 400 and (status != 404 or payload.startswith(b"{")):
        doc = json.loads(payload)
        assert isinstance(doc, dict) and doc.get("message"), f"{what}: {status} {payload[:300]!r}"


def test_the_description_names_every_route_and_no_other() -> None:
    routes = {
        re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", pattern)
        for pattern, _ in elastic_handlers()
        if pattern.startswith("/api/elastic")
    }
    assert routes == set(PATHS)


@FUZZ
@given(
    template=st.sampled_from(sorted(PATHS)),
    method=st.sampled_from(METHODS),
    kernel_id=kernel_ids,
    body=st.one_of(st.none(), json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)),
    query=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)
def test_no_input_gets_a_server_error(
    plain_server: RunningServer, template: str, method: str, kernel_id: str, body: bytes | None, query: dict
) -> None:
    path = template.replace("{kernel_id}", urllib.parse.quote(kernel_id, safe=""))
    if query:
        path += "?" + urllib.parse.urlencode(query)
    if method in ("GET", "DELETE"):
        body = None
    elif body is None:
        body = b""
    status, payload = raw(plain_server, method, path, body)
    check(status, payload, f"{method} {path}")


def test_documented_answers_have_the_documented_shape(plain_server: RunningServer) -> None:
    kernels = plain_server.get("/api/elastic/kernels")
    assert isinstance(kernels, list)
    required = SPEC["components"]["schemas"]["Kernel"]["required"]
    kernel_id = plain_server.start_kernel("python3-gpu-small")
    try:
        one = plain_server.get(f"/api/elastic/kernels/{kernel_id}")
        assert set(required) <= set(one), sorted(set(required) - set(one))
        listed = plain_server.get("/api/elastic/kernels")
        assert all(set(required) <= set(k) for k in listed)
        profiles = plain_server.get("/api/elastic/profiles")["profiles"]
        profile_required = SPEC["components"]["schemas"]["Profile"]["required"]
        assert profiles and all(set(profile_required) <= set(p) for p in profiles)
        isolation = SPEC["components"]["schemas"]["Isolation"]
        for entry in profiles:
            assert set(isolation["required"]) <= set(entry["isolation"])
            for key in ("memory", "compute"):
                assert entry["isolation"][key] in isolation["properties"][key]["enum"]
    finally:
        plain_server.shutdown_kernel(kernel_id)
