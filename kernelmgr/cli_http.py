"""How ``jupyter elastic`` reaches a server: which one (the newest local runtime file, or
``--url``), and its REST API, every failure turned into one readable line (:class:`CliError`)."""

from __future__ import annotations

import glob
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from jupyter_core.paths import jupyter_runtime_dir

#: Seconds to wait for one HTTP answer (``--request-timeout``).
DEFAULT_REQUEST_TIMEOUT = 30.0


class CliError(Exception):
    """A failure to report as one line on stderr with exit code 1."""


class NotFound(CliError):
    """The server answered 404 for a kernel path: an unknown id (a user mistake, exit 2)."""


class RequestTimedOut(CliError):
    """No answer within the request timeout: the server may still be working on it."""


@dataclass(frozen=True)
class Target:
    url: str
    token: str


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return False
    return True


def find_local_server(runtime_dir: str | None = None) -> Target:
    """The newest running server that wrote a ``jpserver-*.json`` runtime file."""
    directory = runtime_dir or jupyter_runtime_dir()
    candidates = sorted(
        glob.glob(os.path.join(directory, "jpserver-*.json")), key=os.path.getmtime, reverse=True
    )
    for path in candidates:
        try:
            with open(path) as handle:
                info = json.load(handle)
        except (OSError, ValueError):
            continue
        if _pid_alive(info.get("pid")) and info.get("url"):
            return Target(url=str(info["url"]).rstrip("/"), token=str(info.get("token", "")))
    raise CliError(f"no running Jupyter server found in {directory}; pass --url and --token")


def resolve_target(url: str | None, token: str | None) -> Target:
    if url:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--url must look like http://host:port/base/, got {url!r}")
        return Target(url=url.rstrip("/"), token=token or os.environ.get("JUPYTER_TOKEN", ""))
    found = find_local_server()
    return Target(url=found.url, token=token or found.token)


def fetch(
    target: Target,
    path: str,
    method: str = "GET",
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
    body: dict[str, Any] | None = None,
) -> Any:
    """Call the API, turning every failure into one readable :class:`CliError`."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(f"{target.url}{path}", method=method, data=data)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if target.token:
        request.add_header("Authorization", f"token {target.token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read()).get("message") or err.reason
        except (ValueError, AttributeError):
            message = err.reason
        if err.code == 403 and message and message != err.reason:  # a refusal that says why (a quota)
            raise CliError(f"HTTP 403 from {target.url}{path}: {message}") from None
        if err.code in (401, 403):
            raise CliError(f"{target.url} refused the request (HTTP {err.code}): check --token") from None
        if err.code == 404 and path.startswith("/api/elastic/") and path.count("/") <= 3:
            raise CliError(
                f"{target.url} has no /api/elastic API: is the kernelmgr extension enabled?"
            ) from None
        if err.code == 404:
            raise NotFound(f"HTTP {err.code} from {target.url}{path}: {message}") from None
        raise CliError(f"HTTP {err.code} from {target.url}{path}: {message}") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise RequestTimedOut(f"no answer from {target.url}{path} within {timeout:g}s") from None
        raise CliError(f"cannot reach {target.url}: {err.reason}") from None
    except TimeoutError:
        raise RequestTimedOut(f"no answer from {target.url}{path} within {timeout:g}s") from None
    except ValueError as err:
        raise CliError(f"bad answer from {target.url}{path}: {err}") from None


def _try_fetch(target: Target, path: str, timeout: float) -> Any:
    """``fetch``, but ``None`` instead of an error (for polls and best-effort reads)."""
    try:
        return fetch(target, path, timeout=timeout)
    except CliError:
        return None
