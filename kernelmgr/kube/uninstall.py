"""Before ``helm uninstall`` removes the gateway: hibernate or stop every kernel of the release, delete
what the gateway made, and say exactly what is left (the chart's pre-delete hook Job).

Kernel pods, their Secrets and the kernel records (ConfigMaps) are made by the gateway, not by the
chart, so ``helm uninstall`` alone leaves them, and a running kernel keeps holding its GPU. This runs
``python -m kernelmgr.kube.uninstall`` from the gateway's image while the gateway still runs:

1. with a gateway admin's token (``--gateway-token-file``), asks the gateway to hibernate every running
   kernel (its variables stay in its checkpoint, on the kept checkpoint volume); without one, or where
   a hibernation fails, the kernel is stopped below and its variables are lost (each is named);
2. scales the gateway's Deployment to 0 and waits for its pods to end, so no gateway recreates a pod
   or a record behind it;
3. deletes the release's kernel pods, warm pods and kept failed pods, their Secrets, and its records
   (with ``--keep-hibernated`` not those of hibernated kernels: they index the kept checkpoints, so a
   release installed again with the same claim and master secret lists those kernels and resumes them);
4. prints what is left: what did not go before the deadline, and what the chart keeps on purpose
   (``--kept``: the checkpoint volume and master secret), and the per-user namespaces.

It never blocks an uninstall for ever: past ``--deadline`` seconds it stops waiting, lists what is
left and exits 0, so ``helm uninstall`` goes on (the Job's ``activeDeadlineSeconds`` covers a pod
that never starts). Every line goes to stdout: ``kubectl logs job/<release>-uninstall``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.config.incluster_config import InClusterConfigLoader

from kernelmgr.kube.labels import COMPONENT_LABEL as COMPONENT_NAME
from kernelmgr.kube.labels import FAILED_KERNEL, KERNEL, KERNEL_ID_LABEL, WARM_KERNEL, common_labels
from kernelmgr.kube.namespaces import namespace_for
from kernelmgr.kube.records import COMPONENT, COMPONENT_LABEL, OWNER_ANNOTATION, REGISTRY_LABEL, STATE_LABEL
from kernelmgr.kube.status import api_message

PREFIX = "uninstall:"
COMPONENTS = (KERNEL, WARM_KERNEL, FAILED_KERNEL)
#: The longest one gateway request may take (a hibernation checkpoints the kernel's variables).
REQUEST_TIMEOUT = 300.0
#: Hibernations asked of the gateway at the same time.
HIBERNATIONS_AT_ONCE = 4


def say(line: str) -> None:
    print(f"{PREFIX} {line}", flush=True)


def kernel_selector(release: str) -> str:
    """This release's kernel, warm and kept failed pods (and their Secrets)."""
    fixed = {k: v for k, v in common_labels(release, KERNEL).items() if k != COMPONENT_NAME}
    return ",".join(
        [*(f"{k}={v}" for k, v in fixed.items()), f"{COMPONENT_NAME} in ({','.join(COMPONENTS)})"]
    )


def record_selector(registry: str) -> str:
    return f"{COMPONENT_LABEL}={COMPONENT},{REGISTRY_LABEL}={registry}"


def gateway_selector(release: str) -> str:
    labels = common_labels(release, "gateway")
    return ",".join(f"{k}={v}" for k, v in labels.items())


class Deadline:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())


def _gateway(url: str, token: str, method: str, path: str, timeout: float) -> tuple[int, Any]:
    """One JSON request to the gateway with the admin's token: (HTTP status, parsed body)."""
    request = urllib.request.Request(
        url.rstrip("/") + "/" + path.lstrip("/"),
        method=method,
        data=b"{}" if method == "POST" else None,
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except ValueError:
            return err.code, {"message": body.decode(errors="replace")[:200]}


def hibernate_all(url: str, token: str, deadline: Deadline) -> set[str]:
    """Ask the gateway to hibernate each running kernel; the ids it hibernated (or already were)."""
    try:
        status, kernels = _gateway(url, token, "GET", "api/elastic/kernels", min(60.0, deadline.left()))
    except OSError as err:
        say(f"the gateway at {url} does not answer ({err}): no kernel is hibernated; all are stopped")
        return set()
    if status != 200 or not isinstance(kernels, list):
        message = kernels.get("message") if isinstance(kernels, dict) else kernels
        say(f"the gateway at {url} refused the kernel list (HTTP {status}: {message}): all are stopped")
        return set()
    done: set[str] = set()
    running: list[tuple[str, str]] = []
    for kernel in kernels:
        kid, state = str(kernel.get("id")), kernel.get("state")
        who = f"kernel {kid} (owner {kernel.get('owner') or '-'}, size {kernel.get('profile') or '-'})"
        if state == "hibernated":
            say(f"{who} was already hibernated: its checkpoint stays on the checkpoint volume")
            done.add(kid)
        elif state == "running":
            running.append((kid, who))
        else:
            say(f"{who} is {state}: stopped, not hibernated")

    def hibernate(kid: str, who: str) -> None:
        if deadline.left() <= 0:
            say(f"{who} not hibernated: the deadline passed; stopped, its variables are lost")
            return
        path = f"api/elastic/kernels/{kid}/hibernate"
        try:
            status, body = _gateway(url, token, "POST", path, min(REQUEST_TIMEOUT, deadline.left()))
        except OSError as err:
            status, body = 0, {"message": str(err)}
        if status == 200:
            say(f"hibernated {who}: its checkpoint stays on the checkpoint volume")
            done.add(kid)
        else:
            message = body.get("message") if isinstance(body, dict) else body
            say(f"{who} not hibernated (HTTP {status}: {message}): stopped, its variables are lost")

    # A few at once: each checkpoint is mostly the kernel's own work, and many kernels must fit the deadline.
    with ThreadPoolExecutor(max_workers=HIBERNATIONS_AT_ONCE) as pool:
        for future in [pool.submit(hibernate, kid, who) for kid, who in running]:
            future.result()
    return done


def stop_gateway(
    core: Any, apps: Any, namespace: str, deployment: str, release: str, deadline: Deadline
) -> None:
    """Scale the gateway to 0 and wait for its pods to end: none may recreate what is deleted next."""
    try:
        apps.patch_namespaced_deployment_scale(deployment, namespace, {"spec": {"replicas": 0}})
    except ApiException as err:
        if err.status == 404:
            say(f"no gateway Deployment {namespace}/{deployment}")
            return
        raise
    say(f"stopped the gateway: Deployment {namespace}/{deployment} scaled to 0")
    selector = gateway_selector(release)
    while deadline.left() > 0:
        if not core.list_namespaced_pod(namespace, label_selector=selector).items:
            return
        time.sleep(min(1.0, deadline.left()))
    names = [p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=selector).items]
    say(f"the gateway's pods did not end before the deadline: {', '.join(names)}")


def _delete(kind: str, namespace: str, name: str, delete: Callable[..., Any]) -> None:
    try:
        delete(name, namespace)
    except ApiException as err:
        if err.status != 404:
            say(f"could not delete {kind} {namespace}/{name}: {api_message(err)}")
            return
    say(f"deleted {kind} {namespace}/{name}")


def _listed(lister: Callable[..., Any], namespaces: Iterable[str] | None, selector: str) -> list[Any]:
    """Objects matching ``selector`` in ``namespaces`` (None: every namespace)."""
    if namespaces is None:
        return list(lister(label_selector=selector).items)
    return [item for ns in namespaces for item in lister(ns, label_selector=selector).items]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernelmgr.kube.uninstall", description=__doc__)
    parser.add_argument("--release", required=True, help="the Helm release (app.kubernetes.io/instance)")
    parser.add_argument("--namespace", required=True, help="the release's namespace (the gateway's)")
    parser.add_argument("--deployment", required=True, help="the gateway's Deployment")
    parser.add_argument(
        "--kernel-namespace", action="append", default=[], help="a namespace the kernels run in (repeat)"
    )
    parser.add_argument("--records-namespace", required=True, help="where the kernel records are")
    parser.add_argument("--records-registry", required=True, help="the records' registry label")
    parser.add_argument("--namespace-template", default="", help="kernels.namespaceTemplate, if any")
    parser.add_argument("--deadline", type=float, required=True, help="seconds before it stops waiting")
    parser.add_argument("--gateway-url", default="", help="the gateway's base URL")
    parser.add_argument("--gateway-token-file", default="", help="a gateway admin's token: hibernate first")
    parser.add_argument(
        "--keep-hibernated",
        action="store_true",
        help="keep the records of hibernated kernels (listed as left)",
    )
    parser.add_argument("--kept", action="append", default=[], help="what the chart keeps (a line each)")
    parser.add_argument(
        "--service-account-dir",
        default="/var/run/secrets/kubernetes.io/serviceaccount",
        help="the pod's ServiceAccount token and CA (in-cluster)",
    )
    args = parser.parse_args(argv)
    if args.deadline <= 0:
        parser.error(f"--deadline must be a positive number of seconds, not {args.deadline:g}")
    deadline = Deadline(args.deadline)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        loader = InClusterConfigLoader(
            token_filename=os.path.join(args.service_account_dir, "token"),
            cert_filename=os.path.join(args.service_account_dir, "ca.crt"),
        )
        loader.load_and_set()
    else:
        config.load_kube_config()
    say(f"release {args.release}: {args.deadline:g} s to hibernate or stop its kernels and remove them")
    hibernated: set[str] = set()
    token = ""
    if args.gateway_token_file:
        try:
            with open(args.gateway_token_file) as f:
                token = f.read().strip()
        except OSError as err:
            say(f"cannot read the gateway token ({err}): kernels are stopped, not hibernated")
    elif args.gateway_url:
        say("no gateway token (uninstallHook.gatewayTokenSecret): kernels are stopped, not hibernated")
    if token and args.gateway_url:
        hibernated = hibernate_all(args.gateway_url, token, deadline)
    with client.ApiClient() as api:
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        try:
            return _remove(args, core, apps, deadline, hibernated)
        except ApiException as err:  # e.g. 403: one line, and the uninstall goes on
            say(f"stopped early: {api_message(err)}; left: see docs/deploy-kubernetes.md#uninstall")
            return 0


def _remove(args: argparse.Namespace, core: Any, apps: Any, deadline: Deadline, hibernated: set[str]) -> int:
    """Stop the gateway, delete the release's kernel objects, and print what is left."""
    stop_gateway(core, apps, args.namespace, args.deployment, args.release, deadline)
    # Per-user namespaces are found where the release's objects are (cluster-wide list) and from the
    # records' owners (a hibernated kernel has no pod).
    namespaces: list[str] | None = None if args.namespace_template else sorted(set(args.kernel_namespace))
    selector = kernel_selector(args.release)
    records = core.list_namespaced_config_map(
        args.records_namespace, label_selector=record_selector(args.records_registry)
    ).items
    list_pods = core.list_pod_for_all_namespaces if namespaces is None else core.list_namespaced_pod
    pods = _listed(list_pods, namespaces, selector)
    for pod in pods:
        labels = pod.metadata.labels or {}
        kid = labels.get(KERNEL_ID_LABEL, "")
        if kid and kid not in hibernated and labels.get(COMPONENT_NAME) == KERNEL:
            say(f"stopping kernel {kid}: not hibernated, its variables are lost")
        _delete("pod", pod.metadata.namespace, pod.metadata.name, core.delete_namespaced_pod)
    secrets = _listed(
        core.list_secret_for_all_namespaces if namespaces is None else core.list_namespaced_secret,
        namespaces,
        selector,
    )
    for secret in secrets:
        _delete("secret", secret.metadata.namespace, secret.metadata.name, core.delete_namespaced_secret)
    kept_records: list[str] = []
    kept_names: set[str] = set()
    for record in records:
        labels = record.metadata.labels or {}
        kid = labels.get(KERNEL_ID_LABEL, "")
        if args.keep_hibernated and (labels.get(STATE_LABEL) == "hibernated" or kid in hibernated):
            owner = (record.metadata.annotations or {}).get(OWNER_ANNOTATION) or "-"
            kept_names.add(record.metadata.name)
            kept_records.append(
                f"kernel record ConfigMap {args.records_namespace}/{record.metadata.name} (hibernated kernel"
                f" {kid} of {owner}: installed again with the same claim and checkpoint secret, the gateway"
                " lists it and its next cell resumes it; uninstallHook.keepHibernated)"
            )
            continue
        _delete(
            "kernel record ConfigMap",
            args.records_namespace,
            record.metadata.name,
            core.delete_namespaced_config_map,
        )
    while deadline.left() > 0:
        if not _listed(list_pods, namespaces, selector):
            break
        time.sleep(min(1.0, deadline.left()))
    # What is left, exactly.
    left_pods = _listed(list_pods, namespaces, selector)
    left = [f"pod {p.metadata.namespace}/{p.metadata.name} (still ending at the deadline)" for p in left_pods]
    left += [
        f"kernel record ConfigMap {args.records_namespace}/{r.metadata.name} (written after the list)"
        for r in core.list_namespaced_config_map(
            args.records_namespace, label_selector=record_selector(args.records_registry)
        ).items
        if r.metadata.name not in kept_names
    ]
    left += kept_records
    if args.namespace_template:
        used = {p.metadata.namespace for p in pods} | {s.metadata.namespace for s in secrets}
        for record in records:
            owner = (record.metadata.annotations or {}).get(OWNER_ANNOTATION)
            if owner:
                used.add(namespace_for(args.namespace_template, owner))
        left += [
            f"namespace {ns} (kernels.namespaceTemplate; its RoleBinding and NetworkPolicies)"
            for ns in sorted(used)
        ]
    left += list(args.kept)
    deleted = len(records) - len(kept_records)
    say(f"done: {len(pods)} pod(s), {len(secrets)} secret(s), {deleted} record(s) deleted; left:")
    for line in left or ["nothing"]:
        say(f"  left: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
