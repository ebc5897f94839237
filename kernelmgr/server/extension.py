"""The ``kernelmgr`` jupyter_server extension.

Linking installs the elastic kernel manager and kernelspec manager into the ServerApp (they
must be in place before the ServerApp creates its managers); loading validates the admin's
configuration, builds the runtime and hands it to the managers and the REST handlers.

A configuration error stops the server with one clear line: a server that silently came up
without its GPU sizes would look healthy while handing out no GPUs, or the wrong ones.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
from typing import TYPE_CHECKING, Any

from jupyter_server.extension.application import ExtensionApp
from jupyter_server.gateway.gateway_client import GatewayClient
from tornado import ioloop
from traitlets import TraitError

from kernelmgr.activity.gpu import GpuActivitySampler
from kernelmgr.backends.local import MANAGED_VARIABLES
from kernelmgr.config import CullPolicy, ElasticKernels, ElasticRuntime
from kernelmgr.core.controller import LifecycleError
from kernelmgr.core.errors import ConfigError
from kernelmgr.kube import optional as kube_optional
from kernelmgr.lifecycle.events import LifecycleEvents
from kernelmgr.lifecycle.metrics import install_collector
from kernelmgr.lifecycle.records import KernelStateFile
from kernelmgr.lifecycle.service import Hibernator
from kernelmgr.provisioners.local import HANDED_OVER
from kernelmgr.server.background import BackgroundCheckpoints
from kernelmgr.server.culler import Culler
from kernelmgr.server.execution_state import ExecutionStates
from kernelmgr.server.gateway_relay import gateway_relay_handlers
from kernelmgr.server.handlers import elastic_handlers, gateway_mode_handlers
from kernelmgr.server.health import Health, health_handlers
from kernelmgr.server.kernelmanager import ElasticMappingKernelManager
from kernelmgr.server.kernelspecs import ElasticKernelSpecManager
from kernelmgr.server.live_config import LiveConfig, sizes
from kernelmgr.server.sessions import ElasticSessionManager, server_identity
from kernelmgr.server.websocket import ElasticWebsocketConnection
from kernelmgr.warm.pool import WarmPools

if TYPE_CHECKING:  # the Kubernetes modules load only in Kubernetes mode (the client is an extra)
    from kernelmgr.server.cluster_activity import ClusterGpuSampler

CONFIG_ERROR_EXIT = 2
#: A gateway that lost its Lease (another one serves the kernels) exits with this code.
LOST_LEASE_EXIT = 3


class ElasticKernelsExtension(ExtensionApp):
    """GPU-size kernels for Jupyter: kernelspecs, slice allocation and the /api/elastic API."""

    name = "kernelmgr"
    load_other_extensions = True

    runtime: ElasticRuntime | None = None
    background: BackgroundCheckpoints | None = None
    node_sync: Any = None
    health: Health | None = None
    live_config: LiveConfig | None = None
    #: The kernel pods a previous server left were adopted (Kubernetes mode; readiness waits for it).
    adopted = False
    #: The label on this pod that the gateway Service selects (several gateways), or None.
    serving_label: Any = None
    #: The server runs its kernels at a gateway (``GatewayClient.url``): the kernels, their GPU
    #: slices and their culling are the gateway's, and this extension stays out of the way.
    kernels_at_gateway = False

    def _link_jupyter_server_extension(self, serverapp: Any) -> None:
        """Install the elastic managers; linking runs before the ServerApp creates its managers."""
        super()._link_jupyter_server_extension(serverapp)
        # The ServerApp makes this same singleton from the same config a moment later.
        gateway_client = GatewayClient.instance(parent=serverapp)
        if gateway_client.gateway_enabled:
            self.kernels_at_gateway = True
            self.log.info(
                "jupyter-elastic-kernels: kernels run at the gateway %s; GPU sizes, hibernation and "
                "culling are the gateway's (set gateway.singleuser's managers in this server)",
                gateway_client.url,
            )
            return
        for trait, ours in (
            ("kernel_manager_class", ElasticMappingKernelManager),
            ("kernel_spec_manager_class", ElasticKernelSpecManager),
            ("session_manager_class", ElasticSessionManager),
            ("kernel_websocket_connection_class", ElasticWebsocketConnection),
        ):
            if serverapp.trait_has_value(trait):
                # Configured explicitly: ours, an admin's subclass of ours, or a conflicting
                # class that initialize_settings reports.
                continue
            setattr(serverapp, trait, ours)

    def initialize_settings(self) -> None:
        if self.kernels_at_gateway:
            return
        try:
            live = self._read_live_config()
            runtime = ElasticKernels(parent=self.serverapp, log=self.log).build()
            policy = CullPolicy(parent=self.serverapp, log=self.log).build(list(runtime.profiles))
        except (ConfigError, TraitError) as exc:
            message = exc.message if isinstance(exc, ConfigError) else " ".join(str(exc).split())
            self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", message)
            sys.exit(CONFIG_ERROR_EXIT)
        assert self.serverapp is not None, "initialize_settings runs after linking"
        km = self.serverapp.kernel_manager
        ksm = self.serverapp.kernel_spec_manager
        if not isinstance(km, ElasticMappingKernelManager) or not isinstance(ksm, ElasticKernelSpecManager):
            self.log.critical(
                "jupyter-elastic-kernels: ServerApp.kernel_manager_class / kernel_spec_manager_class were "
                "overridden (%s, %s); GPU-size kernels need the elastic managers",
                type(km).__name__,
                type(ksm).__name__,
            )
            sys.exit(CONFIG_ERROR_EXIT)
        km.elastic_runtime = runtime
        ksm.elastic_runtime = runtime
        # Kubernetes mode offers python3-cpu, not python3: /api/kernelspecs' default must be offered.
        km.default_kernel_name = ksm.default_for(km.default_kernel_name)
        if runtime.mode.in_pods or runtime.inventory_source == "kubernetes":
            runtime.kube = self._make_cluster(km, runtime)
        state_file = self._kernel_records(runtime)
        lease = self._leader_lease(runtime)
        events = LifecycleEvents(getattr(self.serverapp, "event_logger", None))
        if runtime.mode.in_pods and runtime.kube is not None:
            events.listeners.append(runtime.kube.events.lifecycle)  # Kubernetes Events on the pods
        # Before the recovery lists hibernated kernels: jupyter's execution_state follows each move.
        runtime.states.observers.append(ExecutionStates(km))
        km.hibernator = Hibernator(
            km,
            runtime,
            state_file,
            checkpoint_timeout=runtime.checkpoint_timeout,
            start_timeout=runtime.resume_timeout,
            events=events,
        )
        if lease is None:
            km.hibernator.recover()
        if runtime.inventory_source == "kubernetes":
            from kernelmgr.server.adoption import start_node_inventory

            self.node_sync = start_node_inventory(runtime, self.log)
        self.health = Health(self.log).start()
        self.settings["elastic_health"] = self.health
        if self.node_sync is not None:
            node_sync = self.node_sync
            self.health.readiness.append(lambda: None if node_sync.informer.synced else "nodes not listed")
        if runtime.mode.in_pods:
            # Unready (readyz) until the kernel pods are adopted: by the Lease holder once it leads,
            # else once the loop runs (the pod watch must sync first); the server starts meanwhile.
            # With the serving label a standby is Ready too: the Service selects the label, not readiness.
            if lease is None:
                ioloop.IOLoop.current().add_callback(self._adopt_kernel_pods, km)
            if self.serving_label is None:
                if lease is not None:
                    self.health.readiness.append(lambda: None if lease.serving else "standby")
                self.health.readiness.append(lambda: None if self.adopted else "kernel pods not adopted")
        sampler: GpuActivitySampler | ClusterGpuSampler | None = None
        if runtime.mode.in_pods:
            # The kernels run on other nodes: their GPU activity comes from the node agents.
            from kernelmgr.server.cluster_activity import start_cluster_sampler

            try:
                sampler = start_cluster_sampler(runtime.kube, policy.defaults.gpu_idle_threshold)
            except ConfigError as exc:
                self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", exc.message)
                sys.exit(CONFIG_ERROR_EXIT)
        elif runtime.nvml is not None:
            sampler = GpuActivitySampler(runtime.nvml, busy_threshold=policy.defaults.gpu_idle_threshold)
        km.culler = Culler(
            km,
            runtime,
            km.hibernator,
            policy,
            sampler,
            broadcast=ElasticWebsocketConnection.notify_kernel,
            sample_interval=runtime.gpu_sample_interval,
        )
        km.hibernator.on_resumed.append(ElasticWebsocketConnection.attach_all)
        km.hibernator.loss.on_died.append(ElasticWebsocketConnection.answer_running_cells)
        if live is not None:
            # The sizes first: the policy and the quotas are validated against the new ones.
            live.appliers.append(self._live_profiles(runtime))
            live.appliers.append(self._live_policy(km.culler))
            self.settings["elastic_live_config"] = live
            self.live_config = live.start()
        if runtime.background_checkpoint_interval > 0:
            self.background = BackgroundCheckpoints(
                km.hibernator, runtime.background_checkpoint_interval, policy.max_concurrent_hibernations
            )
        if lease is None:
            self._start_writers(runtime)
        self.settings["elastic_policy"] = policy
        install_collector(lambda: km.elastic_runtime, km.hibernator.released)
        if policy.enabled:
            self.log.info("jupyter-elastic-kernels: cull policy %s", policy.to_dict())
        self.runtime = runtime
        self.settings["elastic_runtime"] = runtime
        if runtime.gpus_available:
            self.log.info(
                "jupyter-elastic-kernels: %s; GPU sizes: %s",
                runtime.inventory.note,
                ", ".join(p.display_name for p in runtime.profiles.values()),
            )
        else:
            self.log.warning("jupyter-elastic-kernels: no GPUs (%s)", runtime.inventory.note)

        reaper = ioloop.PeriodicCallback(km.reap_dead_slices, runtime.reap_interval * 1000)
        reaper.start()
        if lease is not None:
            self._follow_lease(km, runtime, lease, state_file)

    def _start_writers(self, runtime: ElasticRuntime) -> None:
        """What changes kernels on its own (culler, background checkpoints, warm pods): the Lease
        holder's alone when there are several gateways."""
        km = self.serverapp.kernel_manager if self.serverapp is not None else None
        assert isinstance(km, ElasticMappingKernelManager) and km.culler is not None
        km.culler.start()
        if self.background is not None:
            self.background.start()
        self._start_warm_pools(runtime)

    def _read_live_config(self) -> LiveConfig | None:
        """``ElasticKernels.live_config_file``, merged into the server's configuration before anything
        is built from it; invalid: exit code 2 and one line."""
        assert self.serverapp is not None
        elastic = ElasticKernels(parent=self.serverapp)
        if not elastic.live_config_file:
            return None
        if elastic.live_config_interval <= 0:
            self.log.critical(
                "jupyter-elastic-kernels: invalid configuration: ElasticKernels.live_config_interval "
                "must be > 0 seconds, got %s",
                elastic.live_config_interval,
            )
            sys.exit(CONFIG_ERROR_EXIT)
        live = LiveConfig(
            elastic.live_config_file, self.serverapp.config, self.log, elastic.live_config_interval
        )
        try:
            self.serverapp.update_config(live.initial())
        except ConfigError as exc:
            self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        return live

    def _live_profiles(self, runtime: ElasticRuntime) -> Any:
        """The GPU sizes' part of a live change: checked as at start (in Kubernetes mode the new or
        changed sizes' pods dry-run), then swapped in; a removed size is retired, not forgotten."""

        def prepare(config: Any) -> Any:
            new = ElasticKernels(config=config, log=self.log).build_profiles()
            old = runtime.profiles
            removed = [name for name in old if name not in new]
            changed = {name: p for name, p in new.items() if old.get(name) != p}
            if not removed and not changed:
                return lambda: None
            warm = runtime.warm_pods.settings if runtime.warm_pods is not None else {}
            held = sorted(set(removed) & set(warm))
            if held:
                raise ConfigError(
                    f"ElasticKernels.profiles: {', '.join(held)} cannot be removed while "
                    "ElasticKubernetesProvisioner.warm_pods keeps pods of it (a restart can)"
                )
            if runtime.mode.in_pods and runtime.kube is not None:
                from kernelmgr.kube.dry_run import check_kernel_pods

                runtime.kube.settings.check_sizes(list(new))
                check_kernel_pods(runtime.kube, changed, self.log, cpu=False)

            def apply() -> None:
                for name in removed:
                    runtime.retired[name] = old[name]
                for name in new:
                    runtime.retired.pop(name, None)
                runtime.profiles = new
                self.log.info(
                    "jupyter-elastic-kernels: GPU sizes %s (new or changed: %s; no longer offered: %s)",
                    ", ".join(new) or "none",
                    ", ".join(changed) or "none",
                    ", ".join(removed) or "none",
                )

            return apply

        return prepare

    def _live_policy(self, culler: Culler) -> Any:
        """The cull policy's part of a live change: built (validated) first, then applied."""

        def prepare(config: Any) -> Any:
            policy = CullPolicy(config=config, log=self.log).build(sizes(config))

            def apply() -> None:
                culler.set_policy(policy)
                if self.serverapp is not None and self.serverapp.web_app is not None:
                    self.serverapp.web_app.settings["elastic_policy"] = policy
                self.log.info("jupyter-elastic-kernels: cull policy %s", policy.to_dict())

            return apply

        return prepare

    async def _adopt_kernel_pods(self, km: ElasticMappingKernelManager) -> None:
        from kernelmgr.server.adoption import adopt_kernel_pods

        await adopt_kernel_pods(km, self.node_sync)
        self.adopted = True

    def _kernel_records(self, runtime: ElasticRuntime) -> Any:
        """Where the registry of kernels lives: in Kubernetes mode the API (a ConfigMap per kernel,
        :mod:`kernelmgr.kube.records`), any gateway rebuilding its model from one list; else a file
        beside the checkpoints."""
        assert self.serverapp is not None
        identity = server_identity(self.serverapp.root_dir)
        path = os.path.join(runtime.checkpoint_root, f"kernels-{identity}.json")
        if runtime.mode.in_pods:
            from kernelmgr.kube.records import KubeRecordStore

            cluster = runtime.kube
            namespace = cluster.settings.state_namespace or cluster.settings.namespace
            # The file an earlier version kept: imported once (an upgrade), then renamed.
            return KubeRecordStore(cluster.core, namespace, identity, self.log, path)
        return KernelStateFile(path)

    def _leader_lease(self, runtime: ElasticRuntime) -> Any:
        """The Lease (``ElasticLeaderElection.enabled``, Kubernetes mode), not started yet; None with one
        gateway. From here on every write to the cluster asks it first."""
        if not runtime.mode.in_pods:
            return None
        from kernelmgr.kube.leader import ElasticLeaderElection

        election = ElasticLeaderElection(parent=self.serverapp, log=self.log)
        if not election.enabled:
            return None
        from kernelmgr.kube.serving_label import ServingLabel

        cluster = runtime.kube
        try:
            namespace = cluster.settings.state_namespace or cluster.settings.namespace
            lease = election.build(cluster.api(), namespace, cluster.identity)
            label = ServingLabel.of_this_pod(cluster.api(), election.serving_label, self.log)
            if label is not None:
                label.clear()  # before the fence: a standby's one write, to its own pod
        except ConfigError as exc:
            self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        self.serving_label = label
        cluster.fence = lease.check
        runtime.leader = lease
        return lease

    def _follow_lease(
        self, km: ElasticMappingKernelManager, runtime: ElasticRuntime, lease: Any, records: Any
    ) -> None:
        """A standby until the Lease is this gateway's: then it lists the kernels from the API, adopts
        their pods and starts what writes. A holder that loses the Lease exits at once: its kernels
        are the new holder's, and hibernating them on the way out would race it."""
        loop = ioloop.IOLoop.current()

        async def lead() -> None:
            self.log.info("jupyter-elastic-kernels: this gateway leads; taking over the kernels")
            assert km.hibernator is not None
            # One list of the records, off the loop; the recovery then reads it from memory.
            await asyncio.to_thread(records.prefetch)
            km.hibernator.recover()
            self._start_writers(runtime)
            await self._adopt_kernel_pods(km)
            lease.serving = True
            self.log.info("jupyter-elastic-kernels: this gateway serves the kernels")
            if self.serving_label is not None:
                await self.serving_label.mark_while(lease.holds, lease.retry_period)

        def fence() -> None:
            if not lease.holds():
                raise LifecycleError(
                    f"this gateway ({lease.identity}) does not hold the Lease {lease.namespace}/{lease.name}",
                    status=503,
                )

        assert km.hibernator is not None
        km.hibernator.fence = fence

        def lost() -> None:
            self.log.critical("jupyter-elastic-kernels: exiting: another gateway serves the kernels now")
            os._exit(LOST_LEASE_EXIT)

        def release() -> None:  # a graceful stop hands over at once, not after lease_duration
            lease.stop(release=True)

        lease.on_started.append(lambda: loop.add_callback(lead))
        lease.on_lost.append(lost)
        atexit.register(release)
        self.log.info(
            "jupyter-elastic-kernels: standby (%s) until it holds the Lease %s/%s",
            lease.identity,
            lease.namespace,
            lease.name,
        )
        lease.start()

    def _make_cluster(self, km: ElasticMappingKernelManager, runtime: ElasticRuntime) -> Any:
        """The server's KubeCluster, its settings (pod resources, their sizes) checked at start, and
        each size's pod by the API server (a dry-run): a bad one is exit code 2 and one line, not a
        failure at the first kernel. The kernel manager
        stops its watches once the kernels are shut down."""
        try:
            kube_optional.require()
        except ConfigError as exc:
            self.log.critical("jupyter-elastic-kernels: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        from kernelmgr.kube.cluster import KubeCluster
        from kernelmgr.kube.settings import KubeSettings

        try:
            settings = KubeSettings(parent=km)
            settings.check_sizes(list(runtime.profiles))
        except (ConfigError, TraitError) as exc:
            message = exc.message if isinstance(exc, ConfigError) else " ".join(str(exc).split())
            self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", message)
            sys.exit(CONFIG_ERROR_EXIT)
        cluster = KubeCluster(settings, self.log)
        from kernelmgr.kube.dry_run import check_kernel_pods

        try:
            check_kernel_pods(cluster, runtime.profiles, self.log)
        except ConfigError as exc:
            cluster.stop()
            self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        return cluster

    def _start_warm_pools(self, runtime: ElasticRuntime) -> None:
        """Local warm processes (``ElasticKernels.warm_pool``), or Kubernetes warm pods
        (``ElasticKubernetesProvisioner.warm_pods``), filled once the loop runs."""
        if runtime.mode.in_pods:
            self._start_warm_pods(runtime)
        if not runtime.warm_pool:
            return
        if runtime.mode.in_pods:
            self.log.warning(
                "ElasticKernels.warm_pool is for local kernels; with the Kubernetes provisioner set "
                "ElasticKubernetesProvisioner.warm_pods"
            )
            return
        scrubbed = (*MANAGED_VARIABLES, *HANDED_OVER)
        runtime.warm_pools = WarmPools(runtime.warm_pool, scrubbed=scrubbed, log=self.log)
        ioloop.IOLoop.current().add_callback(runtime.warm_pools.schedule_fill)

    def _start_warm_pods(self, runtime: ElasticRuntime) -> None:
        from kernelmgr.kube.warm_pods import build_warm_pods

        try:
            pool = build_warm_pods(runtime.kube, runtime, self.log)
        except ConfigError as exc:
            self.log.critical("jupyter-elastic-kernels: invalid configuration: %s", exc.message)
            sys.exit(CONFIG_ERROR_EXIT)
        if pool is not None:
            runtime.warm_pods = pool
            ioloop.IOLoop.current().add_callback(pool.start)

    def initialize_handlers(self) -> None:
        if self.kernels_at_gateway:
            self.handlers.extend(gateway_mode_handlers())
            self.handlers.extend(gateway_relay_handlers())
        else:
            self.handlers.extend(elastic_handlers())
            self.handlers.extend(health_handlers())

    async def stop_extension(self) -> None:
        """Server stop: the culler stops first, letting running hibernations finish.

        jupyter_server stops extensions before it shuts the kernels down, so no policy
        hibernation starts (or is cut off) while the kernel manager hibernates the kernels
        for the stop; queued ones are dropped and left to that shutdown.
        """
        km = self.serverapp.kernel_manager if self.serverapp is not None else None
        culler = getattr(km, "culler", None)
        if isinstance(culler, Culler):
            await culler.close()
        if self.background is not None:
            await self.background.close()
        if self.health is not None:
            self.health.stop()
        if self.live_config is not None:
            self.live_config.stop()
        if self.node_sync is not None:
            await asyncio.to_thread(self.node_sync.stop)
        if self.runtime is not None and self.runtime.warm_pools is not None:
            self.runtime.warm_pools.close()
        if self.runtime is not None and self.runtime.warm_pods is not None:
            await self.runtime.warm_pods.close()
