"""The multi-tenant elastic kernel gateway, ``jupyter elastic-gateway``.

A headless jupyter_server that runs the kernelmgr extension for many users at once, behind
JupyterHub token auth, with per-user kernel ownership and GPU quotas. Single-user servers
point at it with ``GatewayClient.url``.
"""
