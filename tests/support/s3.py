"""A real S3-compatible server for the tests (``scripts/s3.sh build``), one per test module.

Two servers, both Apache-2.0 and built from Go modules: Versity's S3 gateway (``versitygw``, the
default: a 45 MB binary that builds cold in about 3 minutes, objects as plain files in a folder)
and SeaweedFS (``weed server -s3``: master, volume server, filer and S3 gateway in one process; a
233 MB binary, about an hour cold on two loaded cores). ``ELASTIC_S3_SERVER`` picks one
(``versitygw`` or ``seaweedfs``); unset, the first one built. Each runs on free loopback ports (its
S3 API on a real node's bridge address instead with ``host``, for kernel pods there) with
one admin identity (the server's credential) and one more identity that may not write (to show a
credential that is not the server's gets nothing written). Its data lives in a temporary folder.
Skipped when no binary is built, failed instead under ``ELASTIC_REQUIRE_S3``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kernelmgr.objectstore.client import Bucket, ObjectStoreError
from kernelmgr.objectstore.sigv4 import Credentials
from tests.support.kube import free_port

ROOT = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "ELASTIC_REQUIRE_S3"
#: Starting four servers in one process takes seconds; minutes on two loaded cores.
START_SECONDS = 180.0


SERVER_ENV = "ELASTIC_S3_SERVER"
SERVERS = ("versitygw", "seaweedfs")


def server_binary(server: str) -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "s3.sh"), "path", server], capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def weed_binary() -> Path:
    return server_binary("seaweedfs")


def require_s3() -> tuple[str, Path]:
    """Which server and its binary; skips (or fails under ``ELASTIC_REQUIRE_S3``) when none is built."""
    import pytest

    wanted = os.environ.get(SERVER_ENV, "")
    if wanted and wanted not in SERVERS:
        pytest.fail(f"{SERVER_ENV}={wanted!r}: use one of {', '.join(SERVERS)}", pytrace=False)
    for server in (wanted,) if wanted else SERVERS:
        binary = server_binary(server)
        if binary.is_file():
            return server, binary
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(
            f"{REQUIRE_ENV} is set but no S3 server is built: run scripts/s3.sh build {wanted}".rstrip(),
            pytrace=False,
        )
    pytest.skip("no S3 server built: run `bash scripts/s3.sh build` (needs Go; a few minutes)")


@dataclass
class S3Server:
    endpoint: str
    admin: Credentials
    reader: Credentials
    process: subprocess.Popen[bytes]
    log_path: Path

    def bucket(self, name: str, credentials: Credentials | None = None) -> Bucket:
        return Bucket(self.endpoint, name, credentials or self.admin)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _ports(count: int) -> list[int]:
    """Free ports whose gRPC twins (port + 10000, SeaweedFS's convention) are free as well."""
    found: list[int] = []
    while len(found) < count:
        port = free_port()
        if port < 55000 and port not in found and _bindable(port + 10000):
            found.append(port)
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextmanager
def running_s3(workdir: Path, host: str = "127.0.0.1") -> Iterator[S3Server]:
    """``host``: the address the S3 API listens on (loopback; a real node's bridge address,
    ``Node.gateway_ip``, for kernel pods in its containers to reach it)."""
    kind, binary = require_s3()
    admin = Credentials("elastic-admin", secrets.token_hex(20))
    reader = Credentials("elastic-reader", secrets.token_hex(20))
    workdir.mkdir(parents=True, exist_ok=True)
    if kind == "versitygw":
        with _running_versitygw(binary, workdir, admin, reader, host) as server:
            yield server
        return
    with _running_weed(binary, workdir, admin, reader, host) as server:
        yield server


@contextmanager
def _running_versitygw(
    binary: Path, workdir: Path, admin: Credentials, reader: Credentials, host: str
) -> Iterator[S3Server]:
    """``versitygw posix``: buckets are folders under ``workdir/data``, users in ``workdir/iam``."""
    for name in ("data", "iam"):
        (workdir / name).mkdir(exist_ok=True)
    s3, admin_port = _ports(2)
    log_path = workdir / "versitygw.log"
    env = {**os.environ, "ROOT_ACCESS_KEY": admin.access_key, "ROOT_SECRET_KEY": admin.secret_key}
    args = [
        str(binary), f"--port={host}:{s3}", f"--admin-port=127.0.0.1:{admin_port}",
        f"--iam-dir={workdir / 'iam'}", "--quiet", "posix", str(workdir / "data"),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = S3Server(f"http://{host}:{s3}", admin, reader, proc, log_path)
    try:
        _wait_ready(server)
        # The second identity: a plain user, who owns no bucket and is granted nothing.
        create_user = [
            str(binary), "admin", f"--endpoint-url=http://127.0.0.1:{admin_port}", "create-user",
            f"--access={reader.access_key}", f"--secret={reader.secret_key}", "--role=user",
        ]  # fmt: skip
        subprocess.run(
            create_user,
            env={**os.environ, "ADMIN_ACCESS_KEY": admin.access_key, "ADMIN_SECRET_KEY": admin.secret_key},
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def _running_weed(
    binary: Path, workdir: Path, admin: Credentials, reader: Credentials, host: str
) -> Iterator[S3Server]:
    config = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": admin.access_key, "secretKey": admin.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": reader.access_key, "secretKey": reader.secret_key}],
                "actions": ["Read", "List"],
            },
        ]
    }
    (workdir / "data").mkdir(exist_ok=True)
    config_path = workdir / "s3.json"
    config_path.write_text(json.dumps(config))
    config_path.chmod(0o600)
    master, volume, filer, s3 = _ports(4)
    log_path = workdir / "weed.log"
    args = [
        str(binary), "server", f"-ip={host}", f"-ip.bind={host}", f"-dir={workdir / 'data'}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        "-s3", f"-s3.port={s3}", f"-s3.config={config_path}", "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64", "-volume.max=0",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://{host}:{s3}", admin, reader, proc, log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(proc)


def _wait_ready(server: S3Server) -> None:
    """Until a bucket can be created and an object written and read back (the volume server is up)."""
    probe = server.bucket("ready-probe")
    deadline = time.monotonic() + START_SECONDS
    last = ""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the S3 server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            probe.create()
            probe.put("probe", b"ok")
            if probe.get("probe") == b"ok":
                return
        except (OSError, ObjectStoreError) as exc:
            last = str(exc)
        time.sleep(0.5)
    raise RuntimeError(
        f"the S3 server did not come up in {START_SECONDS:.0f} s ({last}):\n{server.log_tail()}"
    )
