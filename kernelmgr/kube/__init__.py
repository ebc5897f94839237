"""Kubernetes plumbing shared by the pod provisioner: the API client and the one pod watch."""
