"""The multi-tenant elastic kernel gateway (not built yet).

This package will hold ``jupyter elastic-gateway``: a headless jupyter_server that runs the
kernelmgr extension for many users at once, behind JupyterHub token auth, with per-user
kernel ownership and per-user GPU quotas. Single-user servers point at it with
``GatewayClient.url``. Until then, run the kernelmgr extension in each user's server.
"""
