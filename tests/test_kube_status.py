"""The one parser of the API server's Status bodies (``kernelmgr/kube/status.py``) and what each
of its callers makes of each kind of body: the RBAC and admission refusals quote the message (or a
proxy's page), the image awaiter and the uninstall hook print the HTTP status and one line."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from kernelmgr.kube.access import forbidden
from kernelmgr.kube.status import api_message, message_or_body, status_message

pytestmark = pytest.mark.pure


def refused(body: str | bytes | None, status: int = 403, reason: str = "Forbidden") -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = body
    return exc


STATUS = json.dumps(
    {
        "kind": "Status",
        "status": "Failure",
        "message": 'pods is forbidden: User "system:serviceaccount:x:y" cannot create resource\n  "pods"',
        "reason": "Forbidden",
        "code": 403,
    }
)


@pytest.mark.parametrize(
    ("body", "message", "or_body", "one_line"),
    [
        (
            STATUS,
            'pods is forbidden: User "system:serviceaccount:x:y" cannot create resource\n  "pods"',
            'pods is forbidden: User "system:serviceaccount:x:y" cannot create resource\n  "pods"',
            '403 pods is forbidden: User "system:serviceaccount:x:y" cannot create resource "pods"',
        ),
        (STATUS.encode(), json.loads(STATUS)["message"], json.loads(STATUS)["message"], None),
        ('{"kind": "Status", "code": 403}', None, "", "403 Forbidden"),
        ('["not", "a", "status"]', None, "", "403 Forbidden"),
        ("<html>403 from the proxy</html>", None, "<html>403 from the proxy</html>", "403 Forbidden"),
        ("", None, "", "403 Forbidden"),
        (None, None, "", "403 Forbidden"),
    ],
)
def test_each_kind_of_body_reads_as_before(
    body: str | bytes | None, message: str | None, or_body: str, one_line: str | None
) -> None:
    exc = refused(body)
    assert status_message(exc) == message
    assert message_or_body(exc) == or_body
    if one_line is not None:
        assert api_message(exc) == one_line


def test_refusals_quote_the_status_message_or_a_proxys_page() -> None:
    rbac = forbidden(refused(STATUS), "create", "pods", "x")
    assert rbac.api_message == json.loads(STATUS)["message"]
    assert rbac.user == "system:serviceaccount:x:y"
    admission = forbidden(
        refused('{"message": "exceeded quota: compute, requested: cpu=2"}'), "create", "pods", "x"
    )
    assert (
        str(admission)
        == "the API server refused to create pods in namespace x: exceeded quota: compute, requested: cpu=2"
    )
    proxied = forbidden(refused("<html>denied by the proxy</html>"), "create", "pods", "x")
    assert proxied.api_message == "<html>denied by the proxy</html>"
