"""Kernel pods, warm pods and their Secrets, built without a cluster (kernelmgr.kube.manifests).

Plain inputs in, dicts out: these tests need no API server, no runtime and no checkpoint store.
The control-plane tests (test_kubernetes_provisioner.py, test_kube_rbac.py) show the API server
accepts what these functions build.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from kernelmgr.core.errors import ConfigError
from kernelmgr.core.profiles import parse_profile
from kernelmgr.kube.labels import (
    DEFAULT_INSTANCE,
    KERNEL_ID_LABEL,
    KERNEL_WATCH_SELECTOR,
    component_of,
    kernel_id_of,
    kernel_labels,
    label_value,
    legacy_selector,
)
from kernelmgr.kube.manifests import (
    CHECKPOINT_MOUNT,
    ENV_KEY_MOUNTED,
    OWNER_ANNOTATION,
    SIZE_ANNOTATION,
    PodTemplate,
    checkpoint_sub_path,
    make_kernel_pod,
    make_kernel_secret,
    make_warm_pod,
    make_warm_secret,
    owner_reference,
)
from kernelmgr.kube.settings import KubeSettings
from kernelmgr.kube.warm_pod import ENV_TOKEN_FILE

pytestmark = pytest.mark.pure

WHOLE = parse_profile("one", {"gpu_fraction": 1})
AGENT_ENV = {
    "ELASTIC_CHECKPOINT_DIR": "/server/side/path/alice/k-1",
    "ELASTIC_CHECKPOINT_KEY_FILE": "/etc/elastic/checkpoint.key",
    "ELASTIC_KERNEL_ID": "k-1",
    "ELASTIC_OWNER": "alice",
    "ELASTIC_RESTORE": "0",
}


def kernel_pod(template: PodTemplate, profile: Any = WHOLE, sub_path: str | None = "alice") -> dict[str, Any]:
    return make_kernel_pod(
        template,
        name="kernel-k-1",
        kernel_id="k-1",
        cmd=["python", "-m", "kernelmgr.kube.pod_kernel"],
        agent_env=AGENT_ENV,
        owner="alice",
        kernelspec="python3-one",
        profile=profile,
        checkpoint_sub_path=sub_path,
    )


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_kernel_pod_carries_identity_security_and_the_pods_own_paths() -> None:
    template = KubeSettings(checkpoint_claim="ck", extra_labels={"team": "a"}, instance="rel").pod_template()
    pod = kernel_pod(template)
    meta = pod["metadata"]
    # Prefixed labels only: never EG's bare component/kernel_id (kernelmgr/kube/labels.py).
    assert meta["labels"] == {
        "team": "a",
        "app.kubernetes.io/name": "jupyter-elastic-kernels",
        "app.kubernetes.io/instance": "rel",
        "app.kubernetes.io/component": "kernel",
        "elastic.jupyter.org/kernel-id": "k-1",
        "elastic.jupyter.org/owner": "alice",
        "elastic.jupyter.org/gpu-size": "one",  # the slice backend's
    }
    assert meta["annotations"][OWNER_ANNOTATION] == "alice" and meta["annotations"][SIZE_ANNOTATION] == "one"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["terminationGracePeriodSeconds"] == 60
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert spec["securityContext"]["runAsNonRoot"] is True
    container = spec["containers"][0]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = env_of(pod)
    # The agent's paths are the pod's, not the server's.
    assert env["ELASTIC_CHECKPOINT_DIR"] == f"{CHECKPOINT_MOUNT}/k-1" and env[ENV_KEY_MOUNTED] == "1"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["HOME"] == "/home/kernel" and env["TMPDIR"] == "/tmp"
    assert [p["containerPort"] for p in container["ports"]] == [52000, 52001, 52002, 52003, 52004]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["checkpoints"]["subPath"] == "alice" and mounts["connection"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["checkpoints"] == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ck"}}
    assert volumes["connection"]["secret"] == {"secretName": "kernel-k-1", "defaultMode": 0o440}
    # The GPU kernels' default cpu/memory beside the size's own resource (its slice backend's).
    assert container["resources"] == {
        "requests": {"cpu": "1", "memory": "4Gi"},
        "limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
    }


def test_kernel_pod_without_a_claim_or_a_gpu() -> None:
    pod = kernel_pod(KubeSettings().pod_template(), profile=None, sub_path=None)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert "subPath" not in mounts["checkpoints"]
    assert SIZE_ANNOTATION not in pod["metadata"]["annotations"]
    assert pod["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "1Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }


def test_size_resources_replace_the_default_for_their_size_only() -> None:
    whole = {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}}
    template = KubeSettings(size_resources={"one": whole}).pod_template()
    assert kernel_pod(template)["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "4"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"},
    }
    assert template.resources(None)["limits"] == {"cpu": "2", "memory": "4Gi"}


def test_node_lost_tolerations_are_added_unless_configured() -> None:
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    template = KubeSettings(node_lost_seconds=30, tolerations=[own]).pod_template()
    tolerations = kernel_pod(template)["spec"]["tolerations"]
    assert own in tolerations
    not_ready = [t for t in tolerations if t["key"] == "node.kubernetes.io/not-ready"]
    assert not_ready == [
        {
            "key": "node.kubernetes.io/not-ready",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        }
    ]
    assert sum(t["key"] == "node.kubernetes.io/unreachable" for t in tolerations) == 1


def test_a_slice_variable_in_the_pod_is_refused() -> None:
    # KubeSettings refuses it as configuration; a template made some other way is refused here.
    template = PodTemplate(extra_env={"NVIDIA_VISIBLE_DEVICES": "all"})
    with pytest.raises(ConfigError, match="may not set NVIDIA_VISIBLE_DEVICES"):
        kernel_pod(template)


def test_building_is_pure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same inputs, same dict; the inputs are left as they were; nothing is touched on disk."""
    monkeypatch.chdir(tmp_path)
    template = KubeSettings(checkpoint_claim="ck", checkpoint_claim_path="/deep/root").pod_template()
    agent_env = copy.deepcopy(AGENT_ENV)
    first, second = kernel_pod(template), kernel_pod(template)
    assert first == second and first is not second
    assert agent_env == AGENT_ENV
    assert list(tmp_path.iterdir()) == []


def test_kernel_secret_holds_the_connection_and_the_owners_key() -> None:
    info = {"shell_port": 52000, "key": b"abc", "ip": "", "transport": "tcp"}
    secret = make_kernel_secret(
        name="kernel-k-1", kernel_id="k-1", owner="bob@x.org", connection_info=info, checkpoint_key=b"\1" * 32
    )
    assert secret["metadata"]["labels"] == kernel_labels(DEFAULT_INSTANCE, "k-1", "bob@x.org")
    assert kernel_id_of(secret["metadata"]["labels"], DEFAULT_INSTANCE) == "k-1"
    connection = json.loads(secret["stringData"]["connection.json"])
    assert connection == {"shell_port": 52000, "key": "abc", "ip": "0.0.0.0", "transport": "tcp"}
    assert secret["stringData"]["checkpoint.key"] == "01" * 32 + "\n"
    assert info["key"] == b"abc"  # the caller's connection info is not changed


def test_warm_pod_has_no_owner_and_answers_on_the_port_after_the_kernels() -> None:
    template = KubeSettings(first_port=40000).pod_template()
    pod = make_warm_pod(template, name="warm-one-1", profile=WHOLE, preload=("numpy",))
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "warm-kernel"
    assert kernel_id_of(pod["metadata"]["labels"], DEFAULT_INSTANCE) is None  # no kernel's until taken
    assert OWNER_ANNOTATION not in pod["metadata"]["annotations"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "kernelmgr.kube.warm_pod", "--port", "40005", "numpy"]
    assert {"name": "warm", "containerPort": 40005} in container["ports"]
    assert env_of(pod)[ENV_TOKEN_FILE] == "/etc/elastic/warm-token"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert make_warm_secret("warm-one-1", "t")["stringData"] == {"warm-token": "t"}


def test_sub_path_and_owner_reference() -> None:
    assert checkpoint_sub_path("", "alice") == "alice"
    assert checkpoint_sub_path("/team/ck/", "alice") == "team/ck/alice"
    ref = owner_reference("kernel-k-1", "uid-1")["metadata"]["ownerReferences"]
    assert ref == [{"apiVersion": "v1", "kind": "Pod", "name": "kernel-k-1", "uid": "uid-1"}]


def test_settings_read_the_documented_section_and_their_own() -> None:
    """``ElasticKubernetesProvisioner.<key>`` (what configs and the Helm chart write) still applies;
    ``KubeSettings.<key>`` too, and the documented section wins where both set a key."""
    from kernelmgr.provisioners.kubernetes import ElasticKubernetesProvisioner

    config = Config(
        {
            "ElasticKubernetesProvisioner": {"image": "documented:1", "first_port": 41000},
            "KubeSettings": {"image": "new:1", "namespace": "kernels"},
        }
    )
    settings = KubeSettings(config=config)
    assert (settings.image, settings.first_port, settings.namespace) == ("documented:1", 41000, "kernels")
    assert settings.pod_template().warm_pod_port == 41005
    from jupyter_client.kernelspec import KernelSpec

    spec = KernelSpec(argv=["python"], display_name="k", language="python")
    provisioner = ElasticKubernetesProvisioner(kernel_id="k", kernel_spec=spec, config=config, image="spec:1")
    assert (provisioner.image, provisioner.first_port, provisioner.namespace) == ("spec:1", 41000, "kernels")


# ---- per-size pod settings and the pod patch (issue 28)


def test_a_sizes_pod_settings_apply_to_its_pods_only() -> None:
    settings = KubeSettings(
        node_selector={"pool": "gpu"},
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        size_pod_settings={
            "one": {
                "image": "registry/torch:2",
                "nodeSelector": {"gpu-model": "a100"},
                "tolerations": [{"key": "a100", "operator": "Exists"}],
                "priorityClassName": "kernels",
                "runtimeClassName": "nvidia",
                "imagePullSecrets": ["pull", {"name": "other"}],
                "affinity": {"podAntiAffinity": {}},
                "shmSize": "4Gi",
                "ephemeralStorage": "20Gi",
            }
        },
    )
    template = settings.pod_template()
    pod = kernel_pod(template)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "registry/torch:2"
    assert spec["nodeSelector"] == {"pool": "gpu", "gpu-model": "a100"}
    keys = [t["key"] for t in spec["tolerations"]]
    assert keys[:2] == ["gpu", "a100"]
    assert spec["priorityClassName"] == "kernels" and spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "pull"}, {"name": "other"}]
    assert spec["affinity"] == {"podAntiAffinity": {}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["resources"]["limits"]["ephemeral-storage"] == "20Gi"
    # A CPU kernel's pod and another size's have none of it (/dev/shm: the global shm_size).
    for other in (
        kernel_pod(template, profile=None),
        kernel_pod(template, parse_profile("two", {"gpu_fraction": 1})),
    ):
        assert other["spec"]["containers"][0]["image"] == settings.image
        assert other["spec"]["nodeSelector"] == {"pool": "gpu"}
        assert not {"priorityClassName", "runtimeClassName", "imagePullSecrets", "affinity"} & set(
            other["spec"]
        )
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in other["spec"][
            "volumes"
        ]


def test_every_kernel_pod_has_a_dev_shm_unless_turned_off() -> None:
    """The runtime's 64 MiB /dev/shm kills a DataLoader's workers with a bus error: every kernel and
    warm pod gets shm_size (1Gi) as a memory emptyDir; empty turns it off, a size's shmSize wins."""
    template = KubeSettings(shm_size="2Gi", size_pod_settings={"one": {"shmSize": "8Gi"}}).pod_template()
    limits = {
        "cpu": kernel_pod(template, profile=None),
        "one": kernel_pod(template),
        "warm": make_warm_pod(template, name="warm-1", profile=WHOLE, preload=()),
        "two": kernel_pod(template, parse_profile("two", {"gpu_fraction": 1})),
    }
    for which, pod in limits.items():
        (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["sizeLimit"] == ("8Gi" if which in ("one", "warm") else "2Gi"), which
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["spec"]["containers"][0]["volumeMounts"]
    assert KubeSettings().shm_size == "1Gi"
    off = kernel_pod(KubeSettings(shm_size="").pod_template(), profile=None)
    assert all(v["name"] != "dshm" for v in off["spec"]["volumes"])
    from traitlets import TraitError

    with pytest.raises(TraitError, match="shm_size: 'lots' is not a positive Kubernetes quantity"):
        KubeSettings(shm_size="lots")


def test_cpu_kernels_take_their_own_pod_settings() -> None:
    """cpu_pod_settings: the '-cpu' kernelspecs' image, resources, placement, as a size's are."""
    resources = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"cpu": "500m", "memory": "2Gi"}}
    settings = KubeSettings(
        node_selector={"zone": "a"},
        cpu_pod_settings={
            "image": "registry/slim:1",
            "resources": resources,
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "cpu-pool", "operator": "Exists"}],
            "priorityClassName": "batch-low",
            "shmSize": "256Mi",
        },
    )
    cpu = kernel_pod(settings.pod_template(), profile=None)
    spec = cpu["spec"]
    assert spec["containers"][0]["image"] == "registry/slim:1"
    assert spec["containers"][0]["resources"] == resources
    assert spec["nodeSelector"] == {"zone": "a", "pool": "cpu"}
    assert spec["tolerations"][0]["key"] == "cpu-pool" and spec["priorityClassName"] == "batch-low"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}} in spec["volumes"]
    gpu = kernel_pod(settings.pod_template())["spec"]  # a GPU size's pod has none of it
    assert gpu["containers"][0]["image"] == settings.image and gpu["nodeSelector"] == {"zone": "a"}
    assert "priorityClassName" not in gpu
    from traitlets import TraitError

    with pytest.raises(TraitError, match=r"cpu_pod_settings.gpus: unknown key"):
        KubeSettings(cpu_pod_settings={"gpus": 1})


def test_owners_listed_in_user_ids_run_as_their_own_uid_and_gid() -> None:
    """Files a kernel writes on a uid-owned home are its user's; others (and warm pods) run as
    run_as_user."""
    template = KubeSettings(
        run_as_user=1000, user_ids={"alice": {"uid": 2001, "gid": 3001}, "bob": {"uid": 2002}}
    ).pod_template()
    context = kernel_pod(template)["spec"]["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (2001, 3001, 3001)
    assert context["runAsNonRoot"] is True
    assert template.identity("bob") == (2002, 2002) and template.identity("carol") == (1000, 1000)
    warm = make_warm_pod(template, name="warm-1", profile=WHOLE, preload=())["spec"]["securityContext"]
    assert (warm["runAsUser"], warm["runAsGroup"]) == (1000, 1000)
    from traitlets import TraitError

    for bad, said in [
        ({"alice": {"uid": 0}}, "uid 0 is root"),
        ({"alice": {"uid": "1001"}}, "user_ids['alice'].uid must be a number"),
        ({"alice": 1001}, "user_ids['alice'] must be"),
    ]:
        with pytest.raises(TraitError, match=re.escape(said)):
            KubeSettings(user_ids=bad)


def test_user_ids_with_a_checkpoint_claim_start_on_a_server_that_is_not_root() -> None:
    """A root server gives each listed owner's checkpoint folder away (chown); one that is not root
    shares it through its own group (kernelmgr.checkpoint.sharing): both start. (A gid that is the
    server's own group is refused: tests/test_checkpoint_shared_folders.py.)"""
    import os
    import subprocess
    import sys

    check = (
        "from kernelmgr.kube.settings import KubeSettings\n"
        "KubeSettings(checkpoint_claim='ck', user_ids={'alice': {'uid': 2001}}).check_user_files()\n"
    )
    KubeSettings(user_ids={"alice": {"uid": 2001}}).check_user_files()  # no claim: nothing to give
    subprocess.run([sys.executable, "-c", check], check=True)
    if os.geteuid() == 0:
        as_nobody = subprocess.run(
            [sys.executable, "-c", check], user=65534, group=65534, capture_output=True, text=True, cwd="/"
        )
        assert as_nobody.returncode == 0, as_nobody.stderr[-2000:]


def test_a_sizes_resources_replace_the_defaults_and_can_be_guaranteed() -> None:
    guaranteed = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
    template = KubeSettings(size_pod_settings={"one": {"resources": guaranteed}}).pod_template()
    assert kernel_pod(template)["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},  # the API server sets the GPU's request to its limit
        "limits": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
    }


def test_the_pod_patch_merges_last_by_strategic_merge_rules() -> None:
    patch = {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "dnsPolicy": "None",
            "terminationGracePeriodSeconds": None,
            "containers": [
                {"name": "kernel", "env": [{"name": "OMP_NUM_THREADS", "value": "4"}], "workingDir": "/work"},
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
        },
    }
    pod = kernel_pod(KubeSettings(pod_patch=patch).pod_template())
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["labels"][KERNEL_ID_LABEL] == "k-1"
    assert spec["dnsPolicy"] == "None" and "terminationGracePeriodSeconds" not in spec
    kernel, sidecar = spec["containers"]
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    assert kernel["workingDir"] == "/work" and env_of(pod)["OMP_NUM_THREADS"] == "4"
    assert env_of(pod)["ELASTIC_CHECKPOINT_DIR"] == f"{CHECKPOINT_MOUNT}/k-1"  # merged, not replaced
    assert kernel["resources"]["limits"]["nvidia.com/gpu"] == "1"  # after the slice's fragment
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in spec["volumes"]
    # The patch cannot widen the slice either.
    bad = {
        "spec": {
            "containers": [{"name": "kernel", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "all"}]}]
        }
    }
    with pytest.raises(ConfigError, match="may not set CUDA_VISIBLE_DEVICES"):
        kernel_pod(KubeSettings(pod_patch=bad).pod_template())


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"size_pod_settings": {"one": {"gpus": 2}}}, "size_pod_settings['one'].gpus: unknown key"),
        ({"size_pod_settings": {"one": {"shmSize": "lots"}}}, "size_pod_settings['one'].shmSize"),
        ({"size_pod_settings": {"one": {"nodeSelector": {"a": 1}}}}, "size_pod_settings['one'].nodeSelector"),
        (
            {"size_pod_settings": {"one": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}},
            "size_pod_settings['one'].resources.limits.nvidia.com/gpu",
        ),
        ({"pod_patch": {"status": {}}}, "only metadata and spec"),
    ],
)
def test_bad_pod_settings_are_refused_naming_the_size_and_key(setting: dict[str, Any], named: str) -> None:
    from traitlets import TraitError

    with pytest.raises(TraitError) as raised:
        KubeSettings(**setting)
    assert named in str(raised.value)


def test_pod_settings_for_an_unknown_size_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"size_pod_settings names unknown GPU sizes \['big'\]"):
        KubeSettings(size_pod_settings={"big": {"image": "x"}}).check_sizes(["one"])


# ---- the user's files (issue 28)

HOME_CLAIM = {"name": "home", "claimName": "claim-{owner}", "mountPath": "/home/jovyan"}
DATA = {"name": "data", "volume": {"nfs": {"server": "nfs.example", "path": "/export"}}, "mountPath": "/data",
        "subPath": "users/{owner}", "readOnly": True}  # fmt: skip


def user_pod(settings: KubeSettings, owner: str = "alice", requested: str | None = None) -> dict[str, Any]:
    return make_kernel_pod(
        settings.pod_template(),
        name="kernel-k-1",
        kernel_id="k-1",
        cmd=["python"],
        agent_env=AGENT_ENV,
        owner=owner,
        kernelspec="python3-one",
        profile=WHOLE,
        checkpoint_sub_path="alice",
        requested_dir=requested,
    )


def test_the_owners_volumes_mount_into_their_pods_and_home_is_on_the_home_volume() -> None:
    settings = KubeSettings(user_volumes=[HOME_CLAIM, DATA], home_volume="home")
    pod = user_pod(settings, owner="Bob.Smith")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    slug = volumes["user-home"]["persistentVolumeClaim"]["claimName"].removeprefix("claim-")
    assert slug.startswith("bob-smith-")  # a DNS-1123 label: the claim name must be one
    assert volumes["user-data"] == {"name": "user-data", "nfs": {"server": "nfs.example", "path": "/export"}}
    assert mounts["user-data"] == {
        "name": "user-data",
        "mountPath": "/data",
        "subPath": f"users/{slug}",
        "readOnly": True,
    }
    assert mounts["user-home"] == {"name": "user-home", "mountPath": "/home/jovyan"}
    assert env_of(pod)["HOME"] == "/home/jovyan"  # not the emptyDir: pip --user and ~/.cache stay
    assert "home" not in volumes and "home" not in mounts
    assert pod["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert "affinity" not in pod["spec"]  # ReadWriteMany by default: any node
    plain = user_pod(settings, owner="alice")
    assert {v["name"]: v for v in plain["spec"]["volumes"]}["user-home"]["persistentVolumeClaim"] == {
        "claimName": "claim-alice"
    }


@pytest.mark.parametrize(
    ("requested", "chosen"),
    [
        ("/home/jovyan/project/sub", "/home/jovyan/project/sub"),  # GatewayClient's KERNEL_WORKING_DIR
        ("/home/jovyan", "/home/jovyan"),
        ("project", "/home/jovyan/project"),  # relative: under the home volume
        ("/data/set", "/data/set"),  # on another of the user's volumes
        ("/etc", None),  # not the user's: the image's default
        ("/home/jovyan/../../etc", None),
        (None, None),
    ],
)
def test_the_working_directory_follows_the_notebook(requested: str | None, chosen: str | None) -> None:
    pod = user_pod(KubeSettings(user_volumes=[HOME_CLAIM, DATA], home_volume="home"), requested=requested)
    assert pod["spec"]["containers"][0].get("workingDir") == chosen


def test_the_notebook_root_maps_onto_the_home_volumes_mount() -> None:
    home = {**HOME_CLAIM, "mountPath": "/home/user"}
    settings = KubeSettings(user_volumes=[home], home_volume="home", notebook_root="/srv/notebooks")
    pod = user_pod(settings, requested="/srv/notebooks/project")
    assert pod["spec"]["containers"][0]["workingDir"] == "/home/user/project"


def test_a_read_write_once_home_pins_the_pod_to_the_owners_single_user_pod() -> None:
    settings = KubeSettings(
        user_volumes=[HOME_CLAIM],
        home_volume="home",
        home_access_mode="ReadWriteOnce",
        user_pod_namespace="jhub",
        size_pod_settings={"one": {"affinity": {"podAntiAffinity": {"x": 1}}}},
    )
    affinity = user_pod(settings)["spec"]["affinity"]
    assert affinity["podAntiAffinity"] == {"x": 1}  # the size's own affinity stays
    assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {
            "labelSelector": {
                "matchLabels": {"component": "singleuser-server", "hub.jupyter.org/username": "alice"}
            },
            "topologyKey": "kubernetes.io/hostname",
            "namespaces": ["jhub"],
        }
    ]


def test_warm_pods_and_pods_without_user_volumes_are_unchanged() -> None:
    assert "workingDir" not in user_pod(KubeSettings(), requested="/home/jovyan/x")["spec"]["containers"][0]
    warm = make_warm_pod(
        KubeSettings(user_volumes=[HOME_CLAIM], home_volume="home").pod_template(),
        name="warm-1",
        profile=WHOLE,
        preload=(),
    )
    assert not [v for v in warm["spec"]["volumes"] if v["name"].startswith("user-")]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"user_volumes": [{"name": "Home", "claimName": "c", "mountPath": "/h"}]}, "user_volumes[0].name"),
        ({"user_volumes": [{"name": "h", "mountPath": "/h"}]}, "needs one of claimName"),
        (
            {"user_volumes": [{"name": "h", "claimName": "c", "mountPath": "rel"}]},
            "mountPath must be an absolute",
        ),
        ({"user_volumes": [{"name": "h", "claimName": "c", "mountPath": "/tmp/x"}]}, "overlaps"),
        (
            {"user_volumes": [{"name": "h", "claimName": "c", "mountPath": "/h", "subPath": "../x"}]},
            "subPath",
        ),
        ({"home_access_mode": "ReadWriteSometimes"}, "home_access_mode"),
    ],
)
def test_bad_user_volumes_are_refused(setting: dict[str, Any], named: str) -> None:
    from traitlets import TraitError

    with pytest.raises(TraitError) as raised:
        KubeSettings(**setting)
    assert named in str(raised.value)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        (
            {"user_volumes": [HOME_CLAIM], "home_volume": "nope"},
            "home_volume 'nope' is not a user_volumes entry",
        ),
        ({"home_access_mode": "ReadWriteOnce"}, "needs user_volumes"),
        ({"user_volumes": [HOME_CLAIM], "warm_pods": {"one": {"count": 1}}}, "warm_pods cannot be used"),
        ({"user_volumes": [{**HOME_CLAIM, "mountPath": "/home/kernel"}]}, "make it the home_volume"),
    ],
)
def test_user_volume_settings_that_cannot_work_together_are_refused_at_start(
    setting: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        KubeSettings(**setting).check_sizes(["one"])


# ---- the kernelspec's environment and image, the client's KERNEL_* (issue 28)


def test_the_kernelspecs_env_and_the_allowed_client_env_reach_the_pod() -> None:
    from kernelmgr.kube.pod_settings import kernel_environment

    env = kernel_environment(
        {"FRAMEWORK": "jax", "XLA_FLAGS": "--x"},
        {"KERNEL_PROJECT": "p1", "KERNEL_EXTRA_A": "a", "KERNEL_SECRET": "s", "PATH": "/evil", "KERNEL_N": 1},
        ["KERNEL_PROJECT", "KERNEL_EXTRA_*", "PATH"],
    )
    # Only KERNEL_* names, only allowed ones, only strings; the kernelspec's own always.
    assert env == {"FRAMEWORK": "jax", "XLA_FLAGS": "--x", "KERNEL_PROJECT": "p1", "KERNEL_EXTRA_A": "a"}
    template = KubeSettings(extra_env={"TEAM": "ml"}).pod_template()
    pod = make_kernel_pod(
        template,
        name="kernel-k-1",
        kernel_id="k-1",
        cmd=["python"],
        agent_env=AGENT_ENV,
        owner="alice",
        kernelspec="jax-one",
        profile=WHOLE,
        checkpoint_sub_path="alice",
        kernel_env=env,
        image="registry/jax:0.4",
    )
    assert pod["spec"]["containers"][0]["image"] == "registry/jax:0.4"
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names[:4] == ["POD_IP", "TEAM", "FRAMEWORK", "XLA_FLAGS"] and env_of(pod)["KERNEL_PROJECT"] == "p1"
    for bad, named in (({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES"), ({"HOME": "/x"}, "HOME")):
        with pytest.raises(ConfigError, match=f"the kernelspec 'jax-one' may not set {named}"):
            make_kernel_pod(
                template,
                name="kernel-k-1",
                kernel_id="k-1",
                cmd=["python"],
                agent_env=AGENT_ENV,
                owner="alice",
                kernelspec="jax-one",
                profile=WHOLE,
                checkpoint_sub_path="alice",
                kernel_env=bad,
            )


def test_owner_label_is_a_valid_label_value_and_differs_per_owner() -> None:
    value = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
    assert label_value("alice") == "alice" and label_value("Alice.Smith_2") == "Alice.Smith_2"
    owners = ["bob@example.org", "bob-example.org", "_x_", "é" * 40, "a" * 64, "-", "a-1b2c3d4e"]
    labels = [label_value(owner) for owner in owners]
    assert all(value.match(v) and 0 < len(v) <= 63 for v in labels), labels
    assert len(set(labels)) == len(owners)  # "bob@example.org" and "bob-example.org" differ
    assert labels[0].startswith("bob-example.org-")


def test_kernel_pods_of_this_release_and_of_the_previous_labels_are_kernels_no_one_elses() -> None:
    """Pods started before the upgrade (bare component/kernel_id, no instance) are still this
    server's kernels; Enterprise Gateway's (no app name) and another release's are not."""
    assert kernel_id_of(kernel_labels("rel", "k-1", "alice"), "rel") == "k-1"
    assert kernel_id_of(kernel_labels("other", "k-1", "alice"), "rel") is None
    legacy = {"app.kubernetes.io/name": "jupyter-elastic-kernels", "component": "kernel", "kernel_id": "k-0"}
    assert kernel_id_of(legacy, "rel") == "k-0"
    assert kernel_id_of({"component": "kernel", "kernel_id": "eg-1"}, "rel") is None  # EG's
    failed = {**legacy, "component": "kernel-failed"}
    assert kernel_id_of(failed, "rel") is None and component_of(failed, "rel") == "kernel-failed"
    assert component_of({**legacy, "component": "warm-kernel"}, "rel") == "warm-kernel"
    assert "component=kernel" in legacy_selector(
        "kernel"
    ) and "!app.kubernetes.io/component" in legacy_selector("kernel")
    # The pod watch's selector keeps out kept failed pods of both generations.
    assert "app.kubernetes.io/component notin (kernel-failed)" in KERNEL_WATCH_SELECTOR
    assert "component notin (kernel-failed)" in KERNEL_WATCH_SELECTOR.split(",", 2)[2]
    assert kernel_id_of(kernel_labels(DEFAULT_INSTANCE, "k", "a"), DEFAULT_INSTANCE) == "k"


def test_the_pod_entry_point_runs_a_kernelspecs_own_argv_on_the_pods_connection_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernelmgr.kube.pod_kernel import prepare

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    secret = tmp_path / "connection.json"
    secret.write_text(json.dumps({"ip": "0.0.0.0", "shell_port": 52000}))
    argv = ["/opt/jax/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}", "--x"]
    command = prepare(["-f", str(secret), "--", *argv], {"POD_IP": "10.1.2.3"})
    assert command[:4] == argv[:4] and command[5] == "--x"
    assert json.loads(Path(command[4]).read_text())["ip"] == "10.1.2.3"  # the pod's own file
    default = prepare(["-f", str(secret), "--IPKernelApp.x=1"], {"POD_IP": "10.1.2.3"})
    assert default[1:3] == ["-m", "ipykernel_launcher"] and default[-1] == "--IPKernelApp.x=1"
    Path(command[4]).unlink()
    Path(default[4]).unlink()
    with pytest.raises(SystemExit, match="nothing to run"):
        prepare(["-f", str(secret), "--"], {})
    # The argv needs the entry point that writes that file.
    with pytest.raises(ConfigError, match="kernelspec_argv needs the default command"):
        KubeSettings(kernelspec_argv=["jax"], command=["python", "-m", "mykernel"]).check_sizes(["one"])
