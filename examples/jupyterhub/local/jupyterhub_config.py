"""A real JupyterHub on one machine whose users' kernels run at the shared elastic gateway.

    jupyterhub -f examples/jupyterhub/local/jupyterhub_config.py

- configurable-http-proxy from npm (``npm install -g configurable-http-proxy``, or set
  ELASTIC_HUB_PROXY to its path);
- a test authenticator (any user in ELASTIC_HUB_USERS, one shared password from
  ELASTIC_HUB_PASSWORD): for a demo, not for production; local-process single-user servers, each
  as its user's OS account (the same account the user's kernels run as at the gateway);
- the gateway (``jupyter-elastic-gateway``) as a Hub-managed service named ``elastic-gateway``,
  configured by ``jupyter_elastic_gateway_config.py`` beside this file;
- single-user servers pointed at the gateway with their own Hub token, running the project's
  gateway-aware managers, and keeping their notebook-to-kernel sessions in the user's home, so a
  notebook gets its kernel back after the user's server was stopped.

Everything the Hub, the gateway and the users write goes under ELASTIC_HUB_STATE (default
``./elastic-hub-state``). The gateway runs each user's kernels as that user's OS account
(ELASTIC_KERNEL_ACCOUNT, default ``{username}``), so the Hub (and the gateway, its service) runs
as root; Jupyter servers refuse root unless told: set ELASTIC_HUB_ALLOW_ROOT=1 to pass
``--allow-root`` to the single-user servers and the gateway. ELASTIC_SINGLE_TENANT=1 instead runs
every kernel as the gateway's own account: for one person only.
"""

import os
import pwd
import sys

c = get_config()  # noqa: F821 - provided by traitlets when it loads this file

here = os.path.dirname(os.path.abspath(__file__))
state = os.path.abspath(os.environ.get("ELASTIC_HUB_STATE", "elastic-hub-state"))
os.makedirs(state, exist_ok=True)
hub_port = int(os.environ.get("ELASTIC_HUB_PORT", "8000"))
gateway_port = int(os.environ.get("ELASTIC_GATEWAY_PORT", "8899"))
allow_root = os.environ.get("ELASTIC_HUB_ALLOW_ROOT") == "1"
root_flag = ["--allow-root"] if allow_root else []

# -- the Hub ----------------------------------------------------------------------------------
c.JupyterHub.bind_url = f"http://127.0.0.1:{hub_port}"
hub_api_port = int(os.environ.get("ELASTIC_HUB_API_PORT", "8081"))
proxy_api_port = int(os.environ.get("ELASTIC_HUB_PROXY_API_PORT", "8001"))
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{hub_api_port}"
c.JupyterHub.db_url = f"sqlite:///{state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = os.path.join(state, "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = os.path.join(state, "proxy.pid")
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{proxy_api_port}"
if os.environ.get("ELASTIC_HUB_PROXY"):
    c.ConfigurableHTTPProxy.command = [os.environ["ELASTIC_HUB_PROXY"]]

c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = os.environ.get("ELASTIC_HUB_PASSWORD", "elastic-demo")
c.Authenticator.allowed_users = set(os.environ.get("ELASTIC_HUB_USERS", "alice,bob").split(","))
c.Authenticator.admin_users = set(filter(None, os.environ.get("ELASTIC_HUB_ADMINS", "").split(",")))

# Users may reach the gateway service; their servers' tokens get that scope too. The default
# "user" role ("self") is redefined with the two scopes added, which every JupyterHub from 5.0 on
# reads (JupyterHub.extra_user_scopes says the same but only from 6.0: 5.x ignores it).
GATEWAY = "elastic-gateway"
c.JupyterHub.load_roles = [
    {"name": "user", "scopes": ["self", f"access:services!service={GATEWAY}", "read:users:groups!user"]}
]
c.Spawner.server_token_scopes = [
    "users:activity!user",
    "access:servers!server",
    f"access:services!service={GATEWAY}",
    "read:users:groups!user",
]

# -- the gateway, as a Hub-managed service ----------------------------------------------------
gateway_prefix = f"/services/{GATEWAY}/"
c.JupyterHub.services = [
    {
        "name": GATEWAY,
        "url": f"http://127.0.0.1:{gateway_port}",
        "command": [
            sys.executable,
            "-m",
            "gateway.app",
            f"--config={os.path.join(here, 'jupyter_elastic_gateway_config.py')}",
            f"--ServerApp.port={gateway_port}",
            f"--ServerApp.base_url={gateway_prefix}",
            *root_flag,
        ],
        # A Hub-managed service sees only the environment given here.
        "environment": {
            "ELASTIC_HUB_STATE": state,
            "ELASTIC_QUOTA_USERS": os.environ.get("ELASTIC_QUOTA_USERS", ""),
            "ELASTIC_LIVE_CONFIG": os.environ.get("ELASTIC_LIVE_CONFIG", ""),
            "ELASTIC_LIVE_CONFIG_INTERVAL": os.environ.get("ELASTIC_LIVE_CONFIG_INTERVAL", ""),
            "ELASTIC_KERNEL_ACCOUNT": os.environ.get("ELASTIC_KERNEL_ACCOUNT", ""),
            "ELASTIC_SINGLE_TENANT": os.environ.get("ELASTIC_SINGLE_TENANT", ""),
            # Prometheus scrapes /metrics with this token (without it: the gateway's admins only).
            "ELASTIC_METRICS_TOKEN": os.environ.get("ELASTIC_METRICS_TOKEN", ""),
        },
    }
]

# -- single-user servers: kernels at the gateway ----------------------------------------------
single_tenant = os.environ.get("ELASTIC_SINGLE_TENANT") == "1"
account_template = os.environ.get("ELASTIC_KERNEL_ACCOUNT") or "{username}"


def _account_spawner():
    from jupyterhub.spawner import SimpleLocalProcessSpawner, set_user_setuid

    class AccountSpawner(SimpleLocalProcessSpawner):
        """Each user's server runs as the same account as their kernels at the gateway: it offers
        terminals and files, so as the Hub's root it would undo what per-user kernels separate."""

        def make_preexec_fn(self, name):
            account = pwd.getpwnam(account_template.format(username=name))
            home = self.home_dir
            os.makedirs(home, 0o700, exist_ok=True)  # here, in the Hub (root), before the fork
            os.chown(home, account.pw_uid, account.pw_gid)
            drop = set_user_setuid(account.pw_name, chdir=False)

            def preexec():
                drop()
                os.chdir(home)

            return preexec

        def user_env(self, env):
            env = super().user_env(env)
            env["USER"] = account_template.format(username=self.user.name)
            return env

    return AccountSpawner


# A demo for one person: servers as the Hub's own OS user; otherwise as each user's account.
c.JupyterHub.spawner_class = "simple" if single_tenant else _account_spawner()
c.SimpleLocalProcessSpawner.home_dir_template = os.path.join(state, "home", "{username}")
c.Spawner.default_url = "/api/status"
c.Spawner.environment = {
    # The server's own Hub token authenticates it (and its user) at the gateway.
    "JUPYTER_GATEWAY_URL": f"http://127.0.0.1:{gateway_port}{gateway_prefix}",
    "JUPYTER_GATEWAY_AUTH_TOKEN": lambda spawner: spawner.api_token,
}
c.Spawner.args = [
    "--ServerApp.kernel_manager_class=gateway.singleuser.ElasticGatewayMappingKernelManager",
    "--ServerApp.session_manager_class=gateway.singleuser.ElasticGatewaySessionManager",
    # Relays cells to the gateway with Nagle off (the stock relay waits a delayed ACK per cell).
    "--ServerApp.kernel_websocket_connection_class=gateway.singleuser.ElasticGatewayWebSocketConnection",
    # In the user's home: the notebook keeps its kernel across server restarts.
    "--SessionManager.database_filepath=.jupyter-elastic-sessions.db",
    # The gateway's cull policy decides about idle kernels, not the user's server.
    "--MappingKernelManager.cull_idle_timeout=0",
    *root_flag,
]
