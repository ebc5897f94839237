"""Slice backends: turn a GPU size and a placed slice into what a platform needs.

``local`` renders the environment of a local kernel process; the Kubernetes modules render
pod-spec fragments (``kubernetes.render_pod_fragment``). All are pure functions of their
inputs, so each is tested by rendering alone.
"""
