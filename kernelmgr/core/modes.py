"""Where this server runs its GPU-size kernels, and the one definition of each provisioner's name.

The mode is chosen by ``ElasticKernels.kernel_provisioner``; its values are the entry-point names
under ``jupyter_client.kernel_provisioners`` in pyproject.toml (tests/test_architecture.py checks
they agree), so a kernelspec names its provisioner with the same string. Code asks the mode a
question (``in_pods``) instead of comparing provisioner names.
"""

from __future__ import annotations

from enum import Enum


class KernelMode(str, Enum):
    """A local process per kernel (one machine) or a pod per kernel (Kubernetes)."""

    LOCAL = "elastic-local-provisioner"
    KUBERNETES = "elastic-kubernetes-provisioner"

    @property
    def provisioner(self) -> str:
        """The provisioner's entry-point name, as kernelspecs write it."""
        return self.value

    @property
    def in_pods(self) -> bool:
        return self is KernelMode.KUBERNETES


LOCAL_PROVISIONER = KernelMode.LOCAL.provisioner
KUBERNETES_PROVISIONER = KernelMode.KUBERNETES.provisioner
