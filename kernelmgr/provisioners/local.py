"""A local-process kernel provisioner that holds a GPU slice for the kernel's life.

jupyter_client creates one provisioner per kernel (reused across restarts) and calls it at
every step of the kernel's life, which makes it the one place that sees *every* way a kernel
ends. The slice is therefore taken in :meth:`pre_launch` — before any process exists, so a
size that does not fit fails at once — and given back on each of those ends:

* shutdown and server exit: ``cleanup(restart=False)``;
* a crash: the restarter's ``poll()`` sees the exit code first, and we release there, so a
  dead kernel never keeps a GPU even if nobody restarts or shuts it down;
* a restart asked for by the user: the slice is kept from ``shutdown_requested(restart=True)``
  through ``cleanup(restart=True)`` (nobody can take it in the gap) and re-checked,
  idempotently, by the next ``pre_launch``; an automatic restart after a crash releases at the
  crash and allocates again (jupyter_client#1061: the restart flag does not reach every call);
* a launch that fails after the slice was taken: released before the error propagates.

In a multi-user gateway (``ElasticRuntime.kernel_accounts`` set) the process runs as its
owner's OS account, with its connection file, key file and checkpoint folder readable by that
account only, and without the gateway's secrets in its environment
(:mod:`kernelmgr.provisioners.accounts`).

The provisioner is selected by kernelspec metadata (``kernel_provisioner.provisioner_name =
"elastic-local-provisioner"``, written by the generated kernelspecs) and finds the shared
:class:`~kernelmgr.config.ElasticRuntime` on its kernel manager's parent.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import deque
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo, LocalPortCache
from jupyter_client.provisioning import LocalProvisioner
from jupyter_core.paths import jupyter_runtime_dir

from kernelmgr.backends.local import MANAGED_VARIABLES, cpu_environment, local_environment
from kernelmgr.checkpoint.keys import (
    ENV_KEY_FILE,
    key_file_path,
    private_key_dir,
    remove_key_file,
    write_key_file,
)
from kernelmgr.checkpoint.launch import wrap as wrap_for_prefetch
from kernelmgr.checkpoint.termination import EXIT_AFTER_SIGTERM
from kernelmgr.config import ElasticRuntime
from kernelmgr.core.kernels import LaunchPlan, ManagedKernel
from kernelmgr.core.lifecycle import KernelState
from kernelmgr.core.modes import LOCAL_PROVISIONER
from kernelmgr.provisioners.accounts import AccountError, KernelAccount
from kernelmgr.provisioners.common import (
    AGENT_EXTENSION,
    WORKING_DIR_ENV,
    claim_slice,
    find_loss_reports,
    find_runtime,
    mark_launched,
    profile_name_of,
    release_slice,
    with_agent,
)

PROVISIONER_NAME = LOCAL_PROVISIONER
#: What ipykernel (through pyzmq) writes to stderr when one of its ports was taken.
BIND_ERROR = "Address already in use"


#: Agent variables that must come from this provisioner only, never inherited from the server's
#: environment (the removed ``ELASTIC_CHECKPOINT_KEY`` included: a key must never be in it).
HANDED_OVER = (ENV_KEY_FILE, "ELASTIC_CHECKPOINT_KEY", "ELASTIC_RESTORE_CHECKPOINT")

__all__ = ["AGENT_EXTENSION", "PROVISIONER_NAME", "ElasticLocalProvisioner", "find_runtime", "with_agent"]


def base_kernel_of(kernel_spec: Any, kernel_name: str) -> str | None:
    """The base kernelspec a (per-size) kernelspec derives from; its own name otherwise."""
    elastic = (getattr(kernel_spec, "metadata", None) or {}).get("elastic") or {}
    return str(elastic.get("base_kernelspec") or kernel_name) or None


def agent_environment(
    runtime: ElasticRuntime,
    record: ManagedKernel,
    plan: LaunchPlan,
    key_file: Path,
    account: KernelAccount | None = None,
) -> dict[str, str]:
    """What the in-kernel agent needs: where its checkpoints go, whether (and what) to restore,
    and where its owner's key is.

    Writes the owner's key (only that owner's, never the server secret) to ``key_file``, 0600;
    the agent removes it once read. The key itself never enters the environment.
    """
    owner = (account.uid, account.gid) if account is not None else None
    write_key_file(
        key_file,
        runtime.checkpoints.key_for(record.owner),
        owner=owner,
        data_key=runtime.checkpoints.data_key_for(record.owner, record.kernel_id),
    )
    env = runtime.checkpoints.agent_env(
        record.owner,
        record.kernel_id,
        key_file=key_file,
        restore=plan.restore,
        restore_checkpoint=plan.checkpoint,
        # Only the kernel's own account (the server's, or its owner's in a multi-user gateway)
        # can rewrite its checkpoint files: mapping the arrays gives no one else a way in
        # (kernel pods share volumes, so they read).
        restore_mapped=True,
        # A SIGTERM (systemd stopping the server's unit, a shutdown) checkpoints what changed; the
        # next server start lists the kernel as hibernated from it.
        checkpoint_on_sigterm=True,
    )
    env["ELASTIC_SERVER_PID"] = str(os.getpid())
    return env


def exit_in_words(status: int) -> str:
    """Why a kernel process ended, for its user: the signal (with what sends SIGKILL unasked) or
    the exit code."""
    if status >= 0:
        return f"its process exited with code {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    said = f"its process was killed by {name}"
    if -status == signal.SIGKILL:
        said += " (what the out-of-memory killer does when memory runs out)"
    return said


class ElasticLocalProvisioner(LocalProvisioner):
    """Local kernel process + GPU slice bookkeeping."""

    #: Set by ``pre_launch``: ``resume`` or ``start``, what a warm process would be used for.
    _warm_use = "start"
    #: The OS account the kernel runs as (a multi-user gateway), ``None``: the server's own.
    _account: KernelAccount | None = None
    #: The process a shutdown was asked of, and the one whose death notebooks were told of (pids).
    _asked_to_end: int | None = None
    _death_told: int | None = None

    @property
    def runtime(self) -> ElasticRuntime:
        return find_runtime(self.parent, PROVISIONER_NAME)

    @property
    def key_file(self) -> Path:
        """Where this kernel's checkpoint key is handed over: a private directory beside the
        connection files (the Jupyter runtime directory, or the account's own folder for a
        kernel that runs as its owner), never the checkpoint root, which may be a shared volume."""
        accounts = self.runtime.kernel_accounts
        if self._account is not None and accounts is not None:
            return key_file_path(accounts.keys_dir(self._account), self.kernel_id)
        connection_file = getattr(self.parent, "connection_file", "") or ""
        runtime_dir = os.path.dirname(connection_file) if connection_file else jupyter_runtime_dir()
        return key_file_path(private_key_dir(runtime_dir), self.kernel_id)

    @property
    def stderr_file(self) -> Path:
        """Where a cold-started kernel's stderr goes (beside its connection file), so a kernel that
        dies or hangs before it answers can be reported with its own last words."""
        connection_file = getattr(self.parent, "connection_file", "") or ""
        runtime_dir = os.path.dirname(connection_file) if connection_file else jupyter_runtime_dir()
        return Path(runtime_dir) / f"kernel-{self.kernel_id}.stderr"

    def stderr_tail(self, lines: int = 10) -> str:
        """The last ``lines`` lines the kernel wrote to stderr ("" when none or not captured)."""
        try:
            with open(self.stderr_file, encoding="utf-8", errors="replace") as fh:
                return "".join(deque(fh, maxlen=lines)).strip()
        except OSError:
            return ""

    def choose_new_ports(self) -> None:
        """Forget this kernel's ports and connection file, so the next launch picks fresh ones.

        jupyter_client keeps a kernel's ports for its whole life (``ports_cached``, and a connection
        file that is only written once), so a kernel whose port was taken between the choice and the
        bind would fail again on every relaunch.
        """
        km = self.parent
        if km is None or not self.ports_cached:
            return
        cache = LocalPortCache.instance()
        for name in ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port"):
            port = getattr(km, name, 0)
            if port:
                cache.return_port(port)
            setattr(km, name, 0)
        self.ports_cached = False
        km.cleanup_connection_file()

    @property
    def profile_name(self) -> str | None:
        return profile_name_of(self.kernel_spec)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        runtime = self.runtime
        kernelspec_name = getattr(self.parent, "kernel_name", "") or ""
        record, granted, plan = claim_slice(runtime, self.kernel_id, kernelspec_name, self.profile_name)
        self._warm_use = "resume" if record.state is KernelState.RESUMING else "start"
        slice_env = cpu_environment()
        if granted is not None:
            profile = runtime.profile(granted.profile)
            slice_env = local_environment(profile, granted, runtime.inventory, use_mps=runtime.use_mps)
        if BIND_ERROR in self.stderr_tail():
            # The last process of this kernel lost a port to another process before its bind:
            # any relaunch (the restarter's, a resume's) must not try the same ports again.
            self.choose_new_ports()
        try:
            account = self._prepare_account(record)
            # The owner's encryption key (a bucket or a file: read once per owner, off the event
            # loop, before agent_environment); a file system's encrypted checkpoints need it to start.
            if plan.restore or runtime.checkpoints.file_keys is not None:
                await asyncio.to_thread(runtime.checkpoints.prepare, record.owner)
            kwargs = await super().pre_launch(**kwargs)
            env = kwargs.get("env") or {}
            for name in (*MANAGED_VARIABLES, *HANDED_OVER):
                env.pop(name, None)
            if account is not None:
                env = self._as_account(account, env, kwargs)
            else:
                asked = env.get(WORKING_DIR_ENV)
                if asked and os.path.isabs(asked) and os.path.isdir(asked):
                    # The notebook's folder, as a gateway client sends it (jupyter_server's own
                    # start already passes it as cwd). Not with per-user accounts: see _as_account.
                    kwargs["cwd"] = asked
            env.update(slice_env)
            env.update(agent_environment(runtime, record, plan, self.key_file, account))
        except BaseException:
            self._release("launch preparation failed")
            raise
        kwargs["env"] = env
        kwargs["cmd"] = with_agent(list(kwargs["cmd"]))
        # The kernel must outlive a crashed server long enough to checkpoint itself; the agent
        # watches ELASTIC_SERVER_PID instead of ipykernel's parent poller (which would kill it).
        kwargs["independent"] = True
        return kwargs

    def _prepare_account(self, record: ManagedKernel) -> KernelAccount | None:
        """In a multi-user gateway: the owner's account, its runtime and checkpoint folders, and
        the connection file's place in it (set before the manager writes the file)."""
        accounts = self.runtime.kernel_accounts
        if accounts is None:
            self._account = None
            return None
        account = accounts.account_for(record.owner)
        self._account = account
        accounts.owner_checkpoints(account, record.owner)
        if self.parent is not None:
            runtime_dir = accounts.runtime_dir(account)
            self.parent.connection_file = str(runtime_dir / f"kernel-{self.kernel_id}.json")
        return account

    def _as_account(
        self, account: KernelAccount, env: dict[str, str], kwargs: dict[str, Any]
    ) -> dict[str, str]:
        """Hand the connection file to the account and start the process as it: no secrets
        inherited, its own home as the working directory (a folder chosen by the request,
        entered as root, would give the kernel a way into a folder it may not enter), 077."""
        accounts = self.runtime.kernel_accounts
        assert accounts is not None
        connection_file = getattr(self.parent, "connection_file", "")
        if connection_file:
            accounts.hand_over(Path(connection_file), account)
        env = accounts.environment(env, account)
        kwargs["cwd"] = env["HOME"]
        kwargs.update(account.popen_kwargs())
        return env

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        try:
            info = self._launch_warm(cmd, kwargs)
            if info is None:
                info = await self._launch_cold(cmd, kwargs)
        except PermissionError as exc:
            self._release("kernel process failed to launch")
            if self._account is None:
                raise
            raise AccountError(
                f"the kernel command {cmd[0]!r} cannot be run as account {self._account.name!r} "
                f"({exc.strerror}): every folder from / to it must be enterable by that account"
            ) from None
        except BaseException:
            self._release("kernel process failed to launch")
            raise
        mark_launched(self.runtime, self.kernel_id, "process launched")
        return info

    async def _launch_cold(self, cmd: list[str], kwargs: dict[str, Any]) -> KernelConnectionInfo:
        """jupyter_client's launch, with the kernel's stderr (and stdout: ipykernel's banner on
        every start and resume, a library's own prints) in :attr:`stderr_file`, not the server's
        terminal (a file, not a pipe: the kernel must be able to outlive the server and keep
        writing). A resume from an object store starts through :mod:`kernelmgr.checkpoint.launch`:
        its download begins before ipykernel's imports."""
        cmd = wrap_for_prefetch(cmd, kwargs.get("env") or {})
        if "stderr" in kwargs:
            return await super().launch_kernel(cmd, **kwargs)
        # 0600: the kernel's errors are its owner's (the child writes through the inherited descriptor).
        descriptor = os.open(self.stderr_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(descriptor, "wb") as stderr:
            if "stdout" not in kwargs:
                kwargs = {**kwargs, "stdout": stderr}
            return await super().launch_kernel(cmd, stderr=stderr, **kwargs)

    def _launch_warm(self, cmd: list[str], kwargs: dict[str, Any]) -> KernelConnectionInfo | None:
        """Hand this launch to a warm process when a pool serves this kernel; ``None``: start cold.

        The warm process gets what the cold start would have: the same command (with the
        manager's connection file, so ports and key are the manager's), the environment with the
        slice's and the agent's variables, and the notebook's directory.
        """
        runtime = self.runtime
        record = runtime.kernels.get(self.kernel_id)
        if record is not None:
            record.launch_path = "cold"
        if self._account is not None:
            return None  # a warm process has no owner (the gateway refuses warm pools per user)
        pools = runtime.warm_pools
        base = base_kernel_of(self.kernel_spec, getattr(self.parent, "kernel_name", "") or "")
        settings = pools.settings_for(base) if pools is not None else None
        if pools is None or settings is None or base is None:
            return None
        if self._warm_use == "start" and not settings.starts:
            return None
        cwd = str(kwargs.get("cwd") or os.getcwd())
        # A resume's refill waits until the resume is over: the two would share the CPU.
        process, reason = pools.take(
            base,
            self._warm_use,
            list(cmd),
            dict(kwargs.get("env") or {}),
            cwd,
            refill_after=self.kernel_id if self._warm_use == "resume" else None,
        )
        if process is None:
            self.log.info(
                "kernel %s starts cold (%s): warm pool %s: %s", self.kernel_id, self._warm_use, base, reason
            )
            return None
        # A warm process writes its errors elsewhere: the file left by an earlier cold process of
        # this kernel (a bind error, say) must not be read as this launch's failure.
        self.stderr_file.unlink(missing_ok=True)
        self.process = process
        self.pid = process.pid
        try:
            self.pgid = os.getpgid(process.pid)
        except OSError:
            self.pgid = None
        self.cwd = cwd
        if record is not None:
            record.launch_path = "warm"
        self.log.info("kernel %s (%s) took warm process %d", self.kernel_id, self._warm_use, process.pid)
        return self.connection_info

    async def poll(self) -> int | None:
        record = self.runtime.kernels.get(self.kernel_id)
        if record is not None and record.taken_over is not None:
            return None  # hibernated from its own checkpoint; the next cell resumes it
        status = await super().poll()
        restarting = record is not None and record.restarting
        if status is not None and self.process is not None and not restarting:
            if status == EXIT_AFTER_SIGTERM and self._taken_over_as_lost():
                return None
            # The process is gone without a shutdown: a crash or an external kill -9.
            self._tell_died(status)  # first: releasing the slice makes the kernel read as dead
            self._release(f"kernel process exited with status {status}")
        return status

    def _tell_died(self, status: int) -> None:
        """A running kernel's process ended unasked: the cell it ran is answered now, with the
        cause (once per process; the restarter starts it again, empty)."""
        record = self.runtime.kernels.get(self.kernel_id)
        asked = self._asked_to_end == self.pid or self._death_told == self.pid
        if asked or record is None or record.state is not KernelState.RUNNING:
            return
        self._death_told = self.pid
        losses = find_loss_reports(self.parent)
        if losses is not None:
            losses.died(self.kernel_id, exit_in_words(status))

    def _taken_over_as_lost(self) -> bool:
        """The kernel was sent SIGTERM (not by us: we ask with ``shutdown_request``) and exited
        after committing a checkpoint: offer it to the server, which hibernates it from that
        checkpoint, rather than let the restarter start it empty. A crash (a signal, another
        status) restarts it empty, as in plain Jupyter."""
        runtime = self.runtime
        record = runtime.kernels.get(self.kernel_id)
        losses = find_loss_reports(self.parent)
        if losses is None or record is None or record.state is not KernelState.RUNNING:
            return False
        why = "its process was sent SIGTERM"
        # 0.0 as the stop's start: the exit status says the newest checkpoint was written at it.
        if not losses.vanished(self.kernel_id, why, 0.0):
            return False
        runtime.states.taken_over(record, why)
        self.process = None  # exited and reaped: nothing left for the server's stop to wait for
        self._remove_key_file()
        self.log.warning("Kernel %s: %s; hibernated from that checkpoint", self.kernel_id, why)
        return True

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._asked_to_end = self.pid
        self.runtime.states.restart_requested(self.kernel_id, restart)
        await super().shutdown_requested(restart=restart)

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        # The agent removes the key file once it has read it; a process that died before that
        # must not leave it behind (the next launch writes a new one).
        self._remove_key_file()
        if restart:
            return
        self._release("kernel shut down")
        self.runtime.kernels.remove(self.kernel_id)
        try:
            self.stderr_file.unlink(missing_ok=True)
        except OSError as exc:
            self.log.warning("could not remove the stderr file of kernel %s: %s", self.kernel_id, exc)

    def _remove_key_file(self) -> None:
        try:
            remove_key_file(self.key_file)
        except (OSError, ValueError) as exc:
            self.log.warning("could not remove the checkpoint key file of kernel %s: %s", self.kernel_id, exc)

    def _release(self, reason: str) -> None:
        self._remove_key_file()
        release_slice(self.runtime, self.kernel_id, reason, self.log)
