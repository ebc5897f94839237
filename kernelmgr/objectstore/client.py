"""The server's side of the object store: it holds the credential and keeps the bucket's books.

Everything a kernel may do is handed to it as presigned URLs (:func:`Bucket.presign`,
:func:`Bucket.part_urls`); the kernel never sees the key pair. Calls block (standard library HTTP):
the server runs them in a thread, never on its event loop.
"""

from __future__ import annotations

import hashlib
import http.client
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from kernelmgr.objectstore.sigv4 import Credentials, canonical_query, presign, quote, sign_headers

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class ObjectStoreError(Exception):
    """The store refused or failed a request: its status, S3 error code and message."""

    def __init__(self, method: str, key: str, status: int, body: bytes) -> None:
        self.status = status
        self.code = _text(body, "Code") or str(status)
        detail = _text(body, "Message") or body[:200].decode(errors="replace")
        super().__init__(f"{method} {key or '/'}: {status} {self.code}: {detail}")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str


def _text(body: bytes, tag: str) -> str:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return ""
    for element in root.iter():
        if element.tag in (tag, _NS + tag):
            return element.text or ""
    return ""


@dataclass(frozen=True)
class Bucket:
    """One bucket of an S3-compatible server, addressed path-style (``endpoint/bucket/key``)."""

    endpoint: str
    name: str
    credentials: Credentials
    timeout: float = 60.0

    def url(self, key: str = "", query: dict[str, str] | None = None) -> str:
        path = f"/{self.name}/{key}" if key else f"/{self.name}"
        return f"{self.endpoint.rstrip('/')}{quote(path, safe='/')}" + (
            f"?{canonical_query(query)}" if query else ""
        )

    def request(
        self,
        method: str,
        key: str = "",
        query: dict[str, str] | None = None,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[int, dict[str, str], bytes]:
        """One signed request; (status, lower-case headers, body); ``ObjectStoreError`` unless ``ok``."""
        url = self.url(key, query)
        signed = sign_headers(self.credentials, method, url, headers, hashlib.sha256(body).hexdigest())
        parts = urllib.parse.urlsplit(url)
        conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_class(parts.netloc, timeout=self.timeout)
        try:
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request(method, target, body=body or None, headers=signed)
            resp = conn.getresponse()
            data = resp.read()
            got = {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        if resp.status not in ok:
            raise ObjectStoreError(method, key, resp.status, data)
        return resp.status, got, data

    def create(self) -> None:
        """Create the bucket if it does not exist yet."""
        self.request("PUT", ok=(200, 409))

    def put(self, key: str, data: bytes, *, only_if_new: bool = False) -> str:
        """Write ``data`` at ``key`` (atomically: a reader sees the old or the new object); its ETag.

        ``only_if_new`` sends ``If-None-Match: *``: the write fails with 412 if the key exists, so
        two writers cannot both believe they committed.
        """
        headers = {"If-None-Match": "*"} if only_if_new else None
        _, got, _ = self.request("PUT", key, body=data, headers=headers)
        return got.get("etag", "").strip('"')

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes | None:
        """The object's bytes (``start``..``end`` inclusive when given), ``None`` if there is none."""
        headers = {"Range": f"bytes={start}-{'' if end is None else end}"} if start is not None else None
        status, _, data = self.request("GET", key, headers=headers, ok=(200, 206, 404))
        return None if status == 404 else data

    def head(self, key: str) -> ObjectInfo | None:
        status, got, _ = self.request("HEAD", key, ok=(200, 404))
        if status == 404:
            return None
        return ObjectInfo(key, int(got.get("content-length", "0")), got.get("etag", "").strip('"'))

    def delete(self, key: str) -> None:
        self.request("DELETE", key, ok=(200, 204, 404))

    def listing(self, prefix: str, page_size: int = 1000) -> list[ObjectInfo]:
        """Every object under ``prefix``, across as many pages (of ``page_size``) as it takes."""
        found: list[ObjectInfo] = []
        token = ""
        while True:
            query = {"list-type": "2", "prefix": prefix, "max-keys": str(page_size)}
            if token:
                query["continuation-token"] = token
            _, _, data = self.request("GET", query=query)
            root = ET.fromstring(data)
            for item in root.iter(_NS + "Contents"):
                found.append(
                    ObjectInfo(
                        item.findtext(_NS + "Key", ""),
                        int(item.findtext(_NS + "Size", "0")),
                        item.findtext(_NS + "ETag", "").strip('"'),
                    )
                )
            token = root.findtext(_NS + "NextContinuationToken", "")
            if root.findtext(_NS + "IsTruncated", "false") != "true" or not token:
                return found

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; how many there were."""
        objects = self.listing(prefix)
        for item in objects:
            self.delete(item.key)
        return len(objects)

    def presign(self, method: str, key: str, expires: int, query: dict[str, str] | None = None) -> str:
        """A URL that lets its holder make this one request on this one key until it expires."""
        return presign(self.credentials, method, self.url(key, query), expires)

    def start_upload(self, key: str) -> str:
        """Begin a multipart upload of ``key``; its upload id. Nothing is visible until it completes."""
        _, _, data = self.request("POST", key, query={"uploads": ""})
        upload_id = _text(data, "UploadId")
        if not upload_id:
            raise ObjectStoreError(
                "POST", key, 200, b"<Error><Message>no UploadId in the answer</Message></Error>"
            )
        return upload_id

    def part_urls(self, key: str, upload_id: str, count: int, expires: int, first: int = 1) -> list[str]:
        """Presigned PUT URLs for ``count`` parts of an upload from part ``first`` (all a kernel
        needs to send the data)."""
        return [
            self.presign("PUT", key, expires, {"partNumber": str(n), "uploadId": upload_id})
            for n in range(first, first + count)
        ]

    def complete_upload(self, key: str, upload_id: str, etags: list[str]) -> None:
        """Make the upload's object visible, whole, from its parts in order."""
        parts = "".join(
            f'<Part><PartNumber>{n}</PartNumber><ETag>"{etag}"</ETag></Part>'
            for n, etag in enumerate(etags, 1)
        )
        body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
        _, _, data = self.request("POST", key, query={"uploadId": upload_id}, body=body)
        if b"<Error>" in data:  # S3 may answer 200 and put the error in the body
            raise ObjectStoreError("POST", key, 200, data)

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.request("DELETE", key, query={"uploadId": upload_id}, ok=(200, 204, 404))
