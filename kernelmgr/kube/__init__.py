"""Kubernetes plumbing: the API client and the one pod watch (used by the pod provisioner), and
the reader of the node activity agents (:mod:`kernelmgr.kube.node_agents`, used by
:mod:`kernelmgr.server.cluster_activity`)."""
