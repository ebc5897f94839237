"""The node activity agent: per-node GPU activity by pod, without Kubernetes API rights.

``cgroups`` (PID -> pod UID), ``environ`` (PID -> kernel id hint), ``sampler`` (one NVML pass,
attributed to pods), ``metrics`` (Prometheus text) and ``app`` (the HTTP service behind
``jupyter elastic node-agent``). The server-side reader is :mod:`kernelmgr.kube.node_agents`.
"""

#: Defaults of ``jupyter elastic node-agent`` (here, so the CLI can show them without importing tornado).
DEFAULT_PORT = 9401
DEFAULT_INTERVAL = 5.0
