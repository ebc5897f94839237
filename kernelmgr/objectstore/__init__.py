"""Checkpoints in an S3-compatible object store (issue 31).

``sigv4`` signs requests and presigns URLs (AWS Signature Version 4, the scheme every S3-compatible
server speaks); ``client`` is the server's side: it holds the credential and does the bucket's
bookkeeping (multipart uploads, listings, deletes, conditional writes); ``transfer`` is the
kernel's side: it moves bytes through presigned URLs only, in parallel parts and ranges, and
never sees a credential. Only the standard library: no SDK in the kernel image.
"""
