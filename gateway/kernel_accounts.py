"""Which OS account runs a multi-user gateway's local kernels, checked before the gateway serves.

A JupyterHub gateway whose local kernels all run as the gateway's own account gives every user's
cells the other users' kernels, checkpoints, the checkpoint secret and the gateway's Hub token.
So with ``auth = "jupyterhub"`` and local kernels it either runs each kernel as its owner's
account (``kernel_accounts = "per-user"``, the default: the gateway must be root) or the admin
says in so many words that one person uses it (``kernel_accounts = "shared"`` with
``single_tenant = True``). Anything else stops the start with one line and exit code 2.
"""

from __future__ import annotations

import os
from typing import Any

from gateway.config import ElasticGateway
from kernelmgr.config import ElasticKernels, ElasticRuntime
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.modes import LOCAL_PROVISIONER
from kernelmgr.provisioners.accounts import KernelAccounts


def per_user(gateway: ElasticGateway, elastic: ElasticKernels) -> bool:
    """Whether local kernels run as their owners' accounts."""
    return (
        gateway.auth == "jupyterhub"
        and elastic.kernel_provisioner == LOCAL_PROVISIONER
        and gateway.kernel_accounts == "per-user"
    )


def start_up_refusal(gateway: ElasticGateway, elastic: ElasticKernels) -> str | None:
    """Why the gateway must not start with these settings (one line, what to do), or ``None``."""
    if gateway.auth != "jupyterhub" or elastic.kernel_provisioner != LOCAL_PROVISIONER:
        return None
    if gateway.kernel_accounts == "shared":
        if gateway.single_tenant:
            return None
        return (
            "ElasticGateway.kernel_accounts is 'shared': every Hub user's kernel would run as this "
            "gateway's OS account and could read the others' kernels, checkpoints, the checkpoint secret "
            "and the gateway's Hub token; use 'per-user' (run the gateway as root, each kernel runs as its "
            "owner's account), or set ElasticGateway.single_tenant = True if one person uses this gateway"
        )
    if os.geteuid() != 0:
        return (
            "ElasticGateway.kernel_accounts is 'per-user' (each kernel runs as its owner's OS account), "
            f"which needs root, and this gateway runs as uid {os.geteuid()}: run it as root (the Hub "
            "service's user), or use Kubernetes kernels, or kernel_accounts = 'shared' with "
            "ElasticGateway.single_tenant = True for a one-person gateway"
        )
    if elastic.warm_pool:
        return (
            "ElasticKernels.warm_pool cannot be used with ElasticGateway.kernel_accounts = 'per-user' "
            "(a warm process starts before anyone owns it, as the gateway's account): remove warm_pool"
        )
    try:
        KernelAccounts.check_template(gateway.kernel_account)
    except ConfigError as exc:
        return exc.message
    return None


def install(gateway: ElasticGateway, runtime: ElasticRuntime, kernel_spec_manager: Any) -> KernelAccounts:
    """Prepare the per-account folders and make the runtime start kernels as their owners.

    Every kernelspec must then go through the elastic local provisioner (the one that drops
    privileges): a kernelspec naming another provisioner is refused (ConfigError), since
    jupyter_client would run it as root.
    """
    accounts = KernelAccounts(gateway.kernel_account, gateway.kernel_runtime_dir, runtime.checkpoint_root)
    accounts.prepare()
    for name, spec in (kernel_spec_manager.get_all_specs() or {}).items():
        metadata = (spec.get("spec") or {}).get("metadata") or {}
        provisioner = (metadata.get("kernel_provisioner") or {}).get("provisioner_name")
        if provisioner not in (None, LOCAL_PROVISIONER):
            raise ConfigError(
                f"kernelspec {name!r} names the kernel provisioner {provisioner!r}, which would run its "
                f"kernels as the gateway's account (root): remove it, or have it use {LOCAL_PROVISIONER}"
            )
    runtime.kernel_accounts = accounts
    return accounts
