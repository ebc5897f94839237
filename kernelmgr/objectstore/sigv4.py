"""AWS Signature Version 4 for S3: signed headers for the server's own calls, presigned URLs for kernels.

A presigned URL carries its signature in the query string and is valid for one method, one object
(one part of one upload) and a bounded time, so the server can hand a kernel exactly the requests it
may make and nothing else. Written against the published algorithm and checked against AWS's own
worked example (tests/test_objectstore_sigv4.py) and a real server.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import urllib.parse
from dataclasses import dataclass

ALGORITHM = "AWS4-HMAC-SHA256"
#: The payload hash a request sends when its body is not hashed up front (large streamed bodies).
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: The longest validity S3 accepts for a presigned URL.
MAX_EXPIRES = 7 * 24 * 3600


@dataclass(frozen=True)
class Credentials:
    """An access key pair and the region it signs for (S3-compatible servers accept any region name)."""

    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def __repr__(self) -> str:  # never print the secret
        return f"Credentials(access_key={self.access_key!r}, region={self.region!r})"


def quote(text: str, safe: str = "") -> str:
    """URI-encode as SigV4 wants: every byte but ``A-Za-z0-9-_.~`` (and ``safe``) as ``%XX``."""
    return urllib.parse.quote(text, safe="-_.~" + safe)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signing_key(secret_key: str, date: str, region: str, service: str = "s3") -> bytes:
    """The day's key: the secret never signs a request directly."""
    key = _hmac(("AWS4" + secret_key).encode(), date)
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    return key


def canonical_query(query: dict[str, str]) -> str:
    return "&".join(f"{quote(k)}={quote(v)}" for k, v in sorted(query.items()))


def canonical_request(
    method: str, path: str, query: dict[str, str], headers: dict[str, str], payload_hash: str
) -> tuple[str, str]:
    """(the canonical request, the signed header names joined by ``;``); ``headers`` keys lower case."""
    names = sorted(headers)
    lines = [
        method,
        quote(path, safe="/"),
        canonical_query(query),
        "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in names),
        ";".join(names),
        payload_hash,
    ]
    return "\n".join(lines), ";".join(names)


def _signature(creds: Credentials, when: dt.datetime, canonical: str) -> tuple[str, str]:
    """(signature, credential scope) of a canonical request at ``when`` (UTC)."""
    date = when.strftime("%Y%m%d")
    scope = f"{date}/{creds.region}/s3/aws4_request"
    to_sign = "\n".join(
        [ALGORITHM, when.strftime("%Y%m%dT%H%M%SZ"), scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = signing_key(creds.secret_key, date, creds.region)
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest(), scope


def _split(url: str) -> tuple[urllib.parse.SplitResult, dict[str, str]]:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return parts, query


def _now(now: dt.datetime | None) -> dt.datetime:
    return (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc).replace(microsecond=0)


def sign_headers(
    creds: Credentials,
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
    payload_hash: str = EMPTY_SHA256,
    now: dt.datetime | None = None,
) -> dict[str, str]:
    """The headers to send with ``method url``: the given ones plus the date, payload hash and signature.

    ``url``'s path must be sent exactly as given (already unencoded: it is encoded here the way the
    server will); every header passed is signed.
    """
    when = _now(now)
    parts, query = _split(url)
    signed = {k.lower(): v for k, v in (headers or {}).items()}
    signed["host"] = parts.netloc
    signed["x-amz-date"] = when.strftime("%Y%m%dT%H%M%SZ")
    signed["x-amz-content-sha256"] = payload_hash
    canonical, names = canonical_request(
        method, urllib.parse.unquote(parts.path) or "/", query, signed, payload_hash
    )
    signature, scope = _signature(creds, when, canonical)
    signed["authorization"] = (
        f"{ALGORITHM} Credential={creds.access_key}/{scope}, SignedHeaders={names}, Signature={signature}"
    )
    del signed["host"]  # the HTTP client sends it
    return signed


def presign(
    creds: Credentials,
    method: str,
    url: str,
    expires: int,
    now: dt.datetime | None = None,
) -> str:
    """``url`` with a signature in its query: ``method`` on it works without a credential until it expires."""
    if not 1 <= expires <= MAX_EXPIRES:
        raise ValueError(f"a presigned URL lasts 1 s to {MAX_EXPIRES} s, not {expires}")
    when = _now(now)
    parts, query = _split(url)
    date = when.strftime("%Y%m%d")
    query.update(
        {
            "X-Amz-Algorithm": ALGORITHM,
            "X-Amz-Credential": f"{creds.access_key}/{date}/{creds.region}/s3/aws4_request",
            "X-Amz-Date": when.strftime("%Y%m%dT%H%M%SZ"),
            "X-Amz-Expires": str(expires),
            "X-Amz-SignedHeaders": "host",
        }
    )
    path = urllib.parse.unquote(parts.path) or "/"
    canonical, _ = canonical_request(method, path, query, {"host": parts.netloc}, UNSIGNED_PAYLOAD)
    signature, _ = _signature(creds, when, canonical)
    query["X-Amz-Signature"] = signature
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, quote(path, safe="/"), canonical_query(query), "")
    )
