"""SigV4 signing and presigning against AWS's published worked examples (pure)."""

from __future__ import annotations

import datetime as dt

import pytest

from kernelmgr.objectstore.sigv4 import Credentials, presign, sign_headers

# The example credentials and time of AWS's S3 documentation ("Authenticating Requests: Using Query
# Parameters" and "Using the Authorization Header").
EXAMPLE = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "us-east-1")
WHEN = dt.datetime(2013, 5, 24, tzinfo=dt.timezone.utc)

pytestmark = pytest.mark.pure


def test_a_presigned_get_matches_the_documented_example() -> None:
    url = presign(EXAMPLE, "GET", "https://examplebucket.s3.amazonaws.com/test.txt", 86400, now=WHEN)
    assert "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404&" in url
    assert "X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request" in url


def test_a_signed_get_with_a_range_matches_the_documented_example() -> None:
    headers = sign_headers(
        EXAMPLE, "GET", "https://examplebucket.s3.amazonaws.com/test.txt", {"Range": "bytes=0-9"}, now=WHEN
    )
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )


def test_the_secret_is_never_in_a_url_or_a_repr() -> None:
    url = presign(EXAMPLE, "PUT", "http://127.0.0.1:9000/bucket/owner/k", 60, now=WHEN)
    assert EXAMPLE.secret_key not in url and EXAMPLE.secret_key not in repr(EXAMPLE)


@pytest.mark.parametrize("expires", [0, 7 * 24 * 3600 + 1])
def test_a_validity_s3_refuses_is_refused_here(expires: int) -> None:
    with pytest.raises(ValueError, match="a presigned URL lasts"):
        presign(EXAMPLE, "GET", "http://h/b/k", expires)
