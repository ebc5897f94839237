"""Kubernetes slice backends: every backend x size renders a pod that the real API schema accepts.

Each fragment is applied to a minimal valid pod and the result (and every side object) is
checked with ``kubernetes_validate`` in strict mode, which rejects unknown fields: a misspelled
``resourceClaimTemplateName`` or a claim in the wrong place fails here, not on a cluster. The
schema does not check the syntax of map keys and values (resource names, label values), so
those are checked with the apiserver's rules on top.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest

from kernelmgr.backends.common import FRACTION_ANNOTATION, SIZE_LABEL, is_extended_resource_name
from kernelmgr.backends.fragment import PodFragment
from kernelmgr.backends.kubernetes import REGISTRY, render_pod_fragment, validate_backend_options
from kernelmgr.core.errors import ConfigError
from kernelmgr.core.profiles import BACKENDS, GpuProfile, parse_profile

pytestmark = pytest.mark.pure

#: resource.k8s.io/v1 (DRA GA) needs a 1.34+ schema; 1.35 is the first release with DRA stable.
K8S_VERSION = "1.35"
KERNEL_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def profile(name: str, **raw: Any) -> GpuProfile:
    return parse_profile(name, raw)


def base_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "kernel-0f8fad5b", "labels": {"component": "kernel"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "kernel",
                    "image": "quay.io/jupyter/pytorch-notebook:latest",
                    "resources": {"limits": {"cpu": "2", "memory": "8Gi"}},
                    "env": [{"name": "KERNEL_ID", "value": KERNEL_ID}],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def validate(manifest: Mapping[str, Any]) -> None:
    kubernetes_validate.validate(dict(manifest), K8S_VERSION, strict=True)


def assert_qualified_key(key: str) -> None:
    prefix, slash, name = key.rpartition("/")
    assert _QUALIFIED_NAME.match(name) and len(name) <= 63, key
    if slash:
        assert _DNS_SUBDOMAIN.match(prefix) and len(prefix) <= 253, key


def assert_map_syntax(fragment: PodFragment) -> None:
    """What the JSON schema cannot see: names and values inside maps."""
    for key, value in fragment.limits.items():
        assert is_extended_resource_name(key), key
        assert re.fullmatch(r"[0-9]+", value), f"extended resources take whole numbers: {key}={value}"
    for key, value in {**fragment.labels, **fragment.node_selector}.items():
        assert_qualified_key(key)
        assert _LABEL_VALUE.match(value) and len(value) <= 63, (key, value)
    for key in fragment.annotations:
        assert_qualified_key(key)
    for name in fragment.env:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), name
    for obj in fragment.side_objects:
        assert _DNS_SUBDOMAIN.match(obj["metadata"]["name"]), obj["metadata"]["name"]
        for key, value in obj["metadata"].get("labels", {}).items():
            assert_qualified_key(key)
            assert _LABEL_VALUE.match(value), value


CASES: dict[str, GpuProfile] = {
    "whole-1": profile("whole-1", gpu_fraction=1, backend="whole"),
    "whole-2": profile("whole-2", gpu_fraction=2, backend="whole"),
    "mig-mixed": profile(
        "mig-small", gpu_fraction=0.14, memory_mib=10240, backend="mig", options={"mig_profile": "1g.10gb"}
    ),
    "mig-mixed-me": profile(
        "mig-me", gpu_fraction=0.14, memory_mib=10240, backend="mig", options={"mig_profile": "1g.10gb+me"}
    ),
    "mig-single": profile(
        "mig-single",
        gpu_fraction=0.14,
        memory_mib=5120,
        backend="mig",
        options={"strategy": "single", "product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"},
    ),
    "shared-quarter": profile("shared-q", gpu_fraction=0.25, memory_mib=10240, backend="shared"),
    "shared-mps": profile(
        "shared-mps",
        gpu_fraction=0.25,
        memory_mib=20480,
        compute_percent=30,
        backend="shared",
        options={"mps": True, "resource_name": "nvidia.com/gpu", "device_memory_mib": 81920},
    ),
    "shared-whole-replica": profile("shared-1", gpu_fraction=1, backend="shared"),
    "hami-quarter": profile("small", gpu_fraction=0.25, memory_mib=10240, backend="hami"),
    "hami-options": profile(
        "medium",
        gpu_fraction=0.5,
        memory_mib=20000,
        compute_percent=40,
        backend="hami",
        options={
            "scheduler_name": "hami-scheduler",
            "gpu_type": ["A100", "H100"],
            "gpu_scheduler_policy": "binpack",
        },
    ),
    "hami-whole-2": profile("hami-2", gpu_fraction=2, backend="hami"),
    "hami-whole-1-mem": profile("hami-1", gpu_fraction=1, memory_mib=40960, backend="hami"),
    "volcano-quarter": profile(
        "vc-small", gpu_fraction=0.25, memory_mib=8000, compute_percent=25, backend="volcano"
    ),
    "volcano-whole-2": profile("vc-2", gpu_fraction=2, backend="volcano", options={"queue": "research"}),
    "dra-whole-1": profile("dra-1", gpu_fraction=1, backend="dra"),
    "dra-whole-4": profile(
        "dra-4",
        gpu_fraction=4,
        backend="dra",
        options={"selectors": ["device.attributes['gpu.nvidia.com'].productName.matches('H100')"]},
    ),
    "dra-mig": profile(
        "dra-mig", gpu_fraction=0.14, memory_mib=10240, backend="dra", options={"mig_profile": "1g.10gb"}
    ),
    "dra-mps": profile(
        "dra-mps",
        gpu_fraction=0.5,
        memory_mib=40960,
        compute_percent=50,
        backend="dra",
        options={"sharing": "MPS"},
    ),
    "dra-consumable": profile(
        "dra-cc", gpu_fraction=0.25, memory_mib=20480, backend="dra", options={"sharing": "consumable"}
    ),
    "gpushare-quarter": profile("gs-q", gpu_fraction=0.25, memory_mib=4096, backend="gpushare"),
    "gpushare-mib": profile(
        "gs-mib",
        gpu_fraction=0.25,
        memory_mib=3000,
        backend="gpushare",
        options={"memory_unit": "MiB", "device_memory_mib": 16384, "scheduler_name": "gpushare-scheduler"},
    ),
    "gpushare-whole": profile(
        "gs-1", gpu_fraction=1, backend="gpushare", options={"device_memory_mib": 16384}
    ),
    "vcuda-half": profile("vc-half", gpu_fraction=0.5, memory_mib=8000, backend="vcuda"),
    "vcuda-nolimit": profile(
        "vc-q",
        gpu_fraction=0.25,
        memory_mib=4096,
        backend="vcuda",
        options={"core_limit": False, "scheduler_name": "gpu-admission"},
    ),
    "vcuda-whole-2": profile("vc-2x", gpu_fraction=2, memory_mib=16384, backend="vcuda"),
}


def test_cases_cover_every_backend() -> None:
    assert set(REGISTRY) == set(BACKENDS)
    assert {p.backend for p in CASES.values()} == set(BACKENDS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fragment_makes_a_valid_pod(case: str) -> None:
    size = CASES[case]
    validate_backend_options(size)
    fragment = render_pod_fragment(size, KERNEL_ID)
    assert_map_syntax(fragment)

    pod = fragment.apply_to(base_pod())
    validate(pod)
    for obj in fragment.side_objects:
        validate(obj)

    assert pod["metadata"]["labels"] == {"component": "kernel", SIZE_LABEL: size.name}
    assert pod["metadata"]["annotations"][FRACTION_ANNOTATION] == f"{size.gpu_fraction:g}"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["cpu"] == "2"  # the template's own limits survive
    assert {"name": "KERNEL_ID", "value": KERNEL_ID} in container["env"]
    for key, value in fragment.limits.items():
        assert container["resources"]["limits"][key] == value


def test_base_pod_alone_is_valid() -> None:
    validate(base_pod())


def limits_of(size: GpuProfile) -> dict[str, str]:
    return dict(render_pod_fragment(size, KERNEL_ID).limits)


def test_whole_resources() -> None:
    assert limits_of(CASES["whole-1"]) == {"nvidia.com/gpu": "1"}
    assert limits_of(CASES["whole-2"]) == {"nvidia.com/gpu": "2"}
    amd = profile("amd", gpu_fraction=1, backend="whole", options={"resource_name": "amd.com/gpu"})
    assert limits_of(amd) == {"amd.com/gpu": "1"}


def test_mig_resources() -> None:
    assert limits_of(CASES["mig-mixed"]) == {"nvidia.com/mig-1g.10gb": "1"}
    # The device plugin spells '+' as '.', since '+' is not allowed in resource names.
    assert limits_of(CASES["mig-mixed-me"]) == {"nvidia.com/mig-1g.10gb.me": "1"}
    single = render_pod_fragment(CASES["mig-single"], KERNEL_ID)
    assert dict(single.limits) == {"nvidia.com/gpu": "1"}
    assert dict(single.node_selector) == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"}
    pod = single.apply_to(base_pod())
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"}


def test_shared_resources_and_memory_hints() -> None:
    quarter = render_pod_fragment(CASES["shared-quarter"], KERNEL_ID)
    assert dict(quarter.limits) == {"nvidia.com/gpu.shared": "1"}
    assert quarter.env["ELASTIC_GPU_MEMORY_MIB"] == "10240"
    assert quarter.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
    assert quarter.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert quarter.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in quarter.env

    mps = render_pod_fragment(CASES["shared-mps"], KERNEL_ID)
    assert dict(mps.limits) == {"nvidia.com/gpu": "1"}
    assert mps.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"  # 20480 / 81920
    assert mps.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert mps.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"

    whole_replica = render_pod_fragment(CASES["shared-whole-replica"], KERNEL_ID)
    assert "ELASTIC_GPU_MEMORY_MIB" not in whole_replica.env


def test_hami_resources() -> None:
    size = CASES["hami-quarter"]
    fragment = render_pod_fragment(size, KERNEL_ID)
    assert dict(fragment.limits) == {
        "nvidia.com/gpu": "1",
        "nvidia.com/gpumem": str(size.memory_mib),
        "nvidia.com/gpucores": str(size.compute_percent),
    }
    assert fragment.limits["nvidia.com/gpucores"] == "25"
    assert fragment.scheduler_name is None  # HAMi's webhook sets it
    assert "CUDA_DISABLE_CONTROL" in fragment.forbidden_env

    options = render_pod_fragment(CASES["hami-options"], KERNEL_ID)
    assert options.limits["nvidia.com/gpumem"] == "20000"
    assert options.limits["nvidia.com/gpucores"] == "40"
    assert options.scheduler_name == "hami-scheduler"
    assert options.annotations["nvidia.com/use-gputype"] == "A100,H100"
    assert options.annotations["hami.io/gpu-scheduler-policy"] == "binpack"
    assert options.apply_to(base_pod())["spec"]["schedulerName"] == "hami-scheduler"

    assert limits_of(CASES["hami-whole-2"]) == {"nvidia.com/gpu": "2", "nvidia.com/gpucores": "100"}
    assert limits_of(CASES["hami-whole-1-mem"]) == {
        "nvidia.com/gpu": "1",
        "nvidia.com/gpucores": "100",
        "nvidia.com/gpumem": "40960",
    }


def test_volcano_resources() -> None:
    fragment = render_pod_fragment(CASES["volcano-quarter"], KERNEL_ID)
    assert dict(fragment.limits) == {
        "volcano.sh/vgpu-number": "1",
        "volcano.sh/vgpu-memory": "8000",
        "volcano.sh/vgpu-cores": "25",
    }
    assert fragment.scheduler_name == "volcano"
    assert "CUDA_DISABLE_CONTROL" in fragment.forbidden_env
    whole2 = render_pod_fragment(CASES["volcano-whole-2"], KERNEL_ID)
    assert dict(whole2.limits) == {"volcano.sh/vgpu-number": "2", "volcano.sh/vgpu-cores": "100"}
    assert whole2.annotations["scheduling.volcano.sh/queue-name"] == "research"


@pytest.mark.parametrize("case", ["hami-quarter", "hami-whole-2", "volcano-quarter"])
def test_cuda_disable_control_is_stripped(case: str) -> None:
    pod = base_pod()
    pod["spec"]["containers"][0]["env"].append({"name": "CUDA_DISABLE_CONTROL", "value": "true"})
    result = render_pod_fragment(CASES[case], KERNEL_ID).apply_to(pod)
    names = [e["name"] for e in result["spec"]["containers"][0]["env"]]
    assert "CUDA_DISABLE_CONTROL" not in names
    assert "KERNEL_ID" in names


def dra_side(case: str) -> tuple[PodFragment, dict[str, Any]]:
    fragment = render_pod_fragment(CASES[case], KERNEL_ID)
    assert len(fragment.side_objects) == 1
    return fragment, fragment.side_objects[0]


def test_dra_whole_template() -> None:
    fragment, template = dra_side("dra-whole-4")
    assert template["apiVersion"] == "resource.k8s.io/v1"
    assert template["kind"] == "ResourceClaimTemplate"
    name = template["metadata"]["name"]
    assert name.startswith("elastic-gpu-dra-4-")
    assert fragment.pod_resource_claims == ({"name": "gpu", "resourceClaimTemplateName": name},)
    assert fragment.container_claims == ({"name": "gpu"},)
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert request["exactly"]["count"] == 4
    assert request["exactly"]["selectors"] == [
        {"cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.matches('H100')"}}
    ]
    assert fragment.limits == {}

    pod = fragment.apply_to(base_pod())
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": name}]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]


def test_dra_mig_template() -> None:
    _, template = dra_side("dra-mig")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mig.nvidia.com"
    assert request["exactly"]["count"] == 1
    assert request["exactly"]["selectors"] == [
        {"cel": {"expression": "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}
    ]


def test_dra_mps_uses_one_shared_claim() -> None:
    fragment, claim = dra_side("dra-mps")
    assert claim["kind"] == "ResourceClaim"
    assert fragment.pod_resource_claims == ({"name": "gpu", "resourceClaimName": claim["metadata"]["name"]},)
    (config,) = claim["spec"]["devices"]["config"]
    assert config["requests"] == ["gpu"]
    assert config["opaque"]["driver"] == "gpu.nvidia.com"
    parameters = config["opaque"]["parameters"]
    assert parameters["kind"] == "GpuConfig"
    assert parameters["sharing"] == {
        "strategy": "MPS",
        "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "40960Mi"},
    }
    # Every kernel of the size joins the same claim: that is what makes them share the GPU.
    other = render_pod_fragment(CASES["dra-mps"], "another-kernel")
    assert other.pod_resource_claims == fragment.pod_resource_claims


def test_dra_consumable_capacity() -> None:
    _, template = dra_side("dra-consumable")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["capacity"] == {"requests": {"memory": "20480Mi"}}


def test_dra_object_name_follows_the_spec() -> None:
    _, first = dra_side("dra-whole-1")
    _, again = dra_side("dra-whole-1")
    assert first == again
    changed = profile("dra-1", gpu_fraction=1, backend="dra", options={"device_class": "gpu.example.com"})
    renamed = render_pod_fragment(changed, KERNEL_ID).side_objects[0]
    assert renamed["metadata"]["name"] != first["metadata"]["name"]
    assert renamed["metadata"]["name"].startswith("elastic-gpu-dra-1-")


def test_apply_to_does_not_mutate_its_input() -> None:
    pod = base_pod()
    pod["spec"]["containers"][0]["env"].append({"name": "CUDA_DISABLE_CONTROL", "value": "true"})
    before = copy.deepcopy(pod)
    for case in ("hami-options", "dra-mps", "shared-mps", "mig-single"):
        fragment = render_pod_fragment(CASES[case], KERNEL_ID)
        result = fragment.apply_to(pod)
        assert pod == before
        # The result shares no structure with the input or the fragment.
        result["spec"]["containers"][0]["env"].clear()
        result["metadata"]["labels"].clear()
        for claim in result["spec"].get("resourceClaims", []):
            claim["name"] = "mutated"
        assert pod == before
        assert all(c["name"] == "gpu" for c in fragment.pod_resource_claims)


def test_apply_to_merges() -> None:
    pod = base_pod()
    kernel = pod["spec"]["containers"][0]
    kernel["resources"]["requests"] = {"cpu": "1", "nvidia.com/gpu": "3"}
    kernel["env"].append({"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "false"})
    pod["spec"]["schedulerName"] = "default-scheduler"
    pod["spec"]["nodeSelector"] = {"pool": "gpu"}
    pod["spec"]["containers"].append({"name": "sidecar", "image": "busybox"})
    fragment = PodFragment(
        limits={"nvidia.com/gpu": "1"},
        env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
        scheduler_name="volcano",
        node_selector={"nvidia.com/gpu.product": "H100"},
        labels={"a": "b"},
        annotations={"c": "d"},
    )
    result = fragment.apply_to(pod)
    kernel = result["spec"]["containers"][0]
    assert kernel["resources"]["limits"] == {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"}
    assert kernel["resources"]["requests"] == {"cpu": "1", "nvidia.com/gpu": "1"}
    assert [e for e in kernel["env"] if e["name"] == "TF_FORCE_GPU_ALLOW_GROWTH"] == [
        {"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "true"}
    ]
    assert result["spec"]["schedulerName"] == "volcano"
    assert result["spec"]["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "H100"}
    assert result["spec"]["containers"][1] == {"name": "sidecar", "image": "busybox"}
    assert result["metadata"]["annotations"] == {"c": "d"}
    validate(result)


def test_apply_to_other_container_and_missing_container() -> None:
    pod = base_pod()
    pod["spec"]["containers"][0]["name"] = "notebook"
    fragment = render_pod_fragment(CASES["hami-quarter"], KERNEL_ID)
    result = fragment.apply_to(pod, container="notebook")
    assert result["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "10240"
    with pytest.raises(ValueError, match=r"no container named 'kernel'.*'notebook'"):
        fragment.apply_to(pod)
    with pytest.raises(ValueError, match=r"spec\.containers"):
        fragment.apply_to({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})


def test_fragment_is_read_only() -> None:
    fragment = render_pod_fragment(CASES["hami-quarter"], KERNEL_ID)
    with pytest.raises(TypeError):
        fragment.limits["nvidia.com/gpu"] = "8"  # type: ignore[index]


BAD_OPTIONS = [
    ("hami", 0.25, {"gpu_scheduler_policy": "random"}, "gpu_scheduler_policy"),
    ("hami", 0.25, {"scheduler_name": "Hami Scheduler"}, "scheduler_name"),
    ("hami", 0.25, {"gpu_type": "A100,H100"}, "gpu_type"),
    ("hami", 0.25, {"gpumem": 4000}, "gpumem"),
    ("mig", 0.14, {}, "mig_profile"),
    ("mig", 0.14, {"mig_profile": "1g10gb"}, "mig_profile"),
    ("mig", 0.14, {"mig_profile": "nvidia.com/mig-1g.10gb"}, "mig_profile"),
    ("mig", 0.14, {"strategy": "single"}, "product"),
    ("mig", 0.14, {"strategy": "auto", "mig_profile": "1g.10gb"}, "strategy"),
    ("mig", 0.14, {"mig_profile": "1g.10gb", "product": "A100"}, "product"),
    ("shared", 0.25, {"resource_name": "gpu"}, "resource_name"),
    ("shared", 0.25, {"resource_name": "kubernetes.io/gpu"}, "resource_name"),
    ("shared", 0.25, {"mps": "yes"}, "mps"),
    ("shared", 0.25, {"device_memory_mib": 1000}, "device_memory_mib"),
    ("volcano", 0.25, {"queue": ""}, "queue"),
    ("volcano", 0.25, {"schedulerName": "volcano"}, "schedulerName"),
    ("whole", 1, {"resource_name": "nvidia.com/gpu count"}, "resource_name"),
    ("whole", 1, {"mig_profile": "1g.10gb"}, "mig_profile"),
    ("dra", 0.25, {}, "sharing"),
    ("dra", 0.25, {"sharing": "TimeSlicing"}, "sharing"),
    ("dra", 0.25, {"sharing": "MPS", "device_class": "hami-core-gpu.project-hami.io"}, "sharing"),
    ("dra", 1, {"sharing": "MPS"}, "sharing"),
    ("dra", 0.14, {"mig_profile": "1g.10gb", "sharing": "MPS"}, "sharing"),
    ("dra", 1, {"selectors": [""]}, "selectors"),
    ("dra", 1, {"device_class": "GPU"}, "device_class"),
    ("dra", 1, {"count": 2}, "count"),
    ("gpushare", 0.25, {"memory_unit": "GB"}, "memory_unit"),
    ("gpushare", 0.25, {"device_memory_mib": 4096}, "device_memory_mib"),
    ("gpushare", 0.25, {"device_memory_mib": "16Gi"}, "device_memory_mib"),
    ("gpushare", 1, {}, "device_memory_mib"),
    ("gpushare", 0.25, {"gpu_count": 1}, "gpu_count"),
    ("vcuda", 0.25, {"core_limit": "yes"}, "core_limit"),
    ("vcuda", 0.25, {"scheduler_name": "GPU Admission"}, "scheduler_name"),
]


@pytest.mark.parametrize(("backend", "fraction", "options", "key"), BAD_OPTIONS)
def test_bad_options_name_the_key(backend: str, fraction: float, options: dict[str, Any], key: str) -> None:
    raw: dict[str, Any] = {"gpu_fraction": fraction, "backend": backend, "options": options}
    if fraction < 1:
        raw["memory_mib"] = 10240
    size = parse_profile("bad", raw)
    expected = re.escape(f"ElasticKernels.profiles['bad'].options.{key}: ")
    with pytest.raises(ConfigError, match=expected):
        validate_backend_options(size)
    with pytest.raises(ConfigError, match=expected):
        render_pod_fragment(size, KERNEL_ID)


def test_unknown_option_lists_the_allowed_ones() -> None:
    size = profile("bad", gpu_fraction=0.25, memory_mib=4096, backend="hami", options={"gpumem": 1})
    with pytest.raises(ConfigError) as caught:
        validate_backend_options(size)
    assert "gpu_scheduler_policy, gpu_type, scheduler_name" in caught.value.message


@pytest.mark.parametrize(
    ("backend", "fraction", "options"),
    [
        ("mig", 2, {"mig_profile": "1g.10gb"}),
        ("shared", 2, {}),
        ("dra", 2, {"mig_profile": "1g.10gb"}),
        ("gpushare", 2, {"device_memory_mib": 16384}),
    ],
)
def test_sizes_a_backend_cannot_express(backend: str, fraction: float, options: dict[str, Any]) -> None:
    size = profile("bad", gpu_fraction=fraction, backend=backend, options=options)
    with pytest.raises(ConfigError, match=re.escape("ElasticKernels.profiles['bad'].gpu_fraction: ")):
        validate_backend_options(size)


def test_unknown_backend_is_a_config_error() -> None:
    size = GpuProfile("odd", "Odd", 0.5, 1024, 50, "cgpu")
    with pytest.raises(ConfigError, match=re.escape("ElasticKernels.profiles['odd'].backend: ")):
        render_pod_fragment(size, KERNEL_ID)


def test_gpushare_resources_and_memory_hints() -> None:
    quarter = render_pod_fragment(CASES["gpushare-quarter"], KERNEL_ID)
    assert dict(quarter.limits) == {"aliyun.com/gpu-mem": "4"}  # GiB
    assert quarter.scheduler_name is None  # the extender runs inside the default scheduler
    # gpushare enforces nothing: the kernel is told its share in the frameworks' own variables
    assert quarter.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
    assert quarter.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert quarter.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert quarter.env["ELASTIC_GPU_MEMORY_FRACTION"] == "0.250"
    assert quarter.env["ELASTIC_GPU_MEMORY_MIB"] == "4096"
    mib = render_pod_fragment(CASES["gpushare-mib"], KERNEL_ID)
    assert dict(mib.limits) == {"aliyun.com/gpu-mem": "3000"}
    assert mib.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.183"  # 3000 / 16384, not the size's 0.25
    assert mib.scheduler_name == "gpushare-scheduler"
    whole = render_pod_fragment(CASES["gpushare-whole"], KERNEL_ID)
    assert dict(whole.limits) == {"aliyun.com/gpu-mem": "16"}  # the whole card's memory
    assert whole.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1.000"


def test_gpushare_memory_must_be_whole_gib_in_the_gib_unit() -> None:
    size = profile("gs", gpu_fraction=0.25, memory_mib=3000, backend="gpushare")
    with pytest.raises(ConfigError, match=re.escape("ElasticKernels.profiles['gs'].memory_mib: 3000 is not")):
        validate_backend_options(size)


def test_shared_and_gpushare_tell_the_kernel_its_share_the_same_way() -> None:
    """One helper writes the framework variables for every backend that enforces no memory cap."""
    shared = render_pod_fragment(
        profile("a", gpu_fraction=0.25, memory_mib=4096, backend="shared"), KERNEL_ID
    )
    gpushare = render_pod_fragment(CASES["gpushare-quarter"], KERNEL_ID)
    assert {k: v for k, v in shared.env.items() if k != "ELASTIC_GPU_PROFILE"} == {
        k: v for k, v in gpushare.env.items() if k != "ELASTIC_GPU_PROFILE"
    }


def test_gpushare_assigned_device_read_back() -> None:
    from kernelmgr.backends.gpushare import assigned_device

    assert assigned_device(None) is None
    assert assigned_device({"elastic.jupyter.org/gpu-size": "x"}) is None
    annotations = {
        "ALIYUN_COM_GPU_MEM_IDX": "1",
        "ALIYUN_COM_GPU_MEM_DEV": "15",
        "ALIYUN_COM_GPU_MEM_POD": "4",
        "ALIYUN_COM_GPU_MEM_ASSUME_TIME": "1700000000000000000",
        "ALIYUN_COM_GPU_MEM_ASSIGNED": "true",
    }
    assert assigned_device(annotations) == {
        "mechanism": "gpushare",
        "index": 1,
        "device_memory": 15,
        "pod_memory": 4,
        "assume_time": 1700000000000000000,
        "assigned": True,
    }
    assert assigned_device({"ALIYUN_COM_GPU_MEM_IDX": "?"}) == {
        "mechanism": "gpushare",
        "index": None,
        "device_memory": None,
        "pod_memory": None,
        "assume_time": None,
        "assigned": False,
    }


def test_vcuda_resources() -> None:
    half = render_pod_fragment(CASES["vcuda-half"], KERNEL_ID)
    assert dict(half.limits) == {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "32"}  # 8000/256
    assert half.annotations["tencent.com/vcuda-core-limit"] == "50"
    nolimit = render_pod_fragment(CASES["vcuda-nolimit"], KERNEL_ID)
    assert "tencent.com/vcuda-core-limit" not in nolimit.annotations
    assert nolimit.scheduler_name == "gpu-admission"
    whole = render_pod_fragment(CASES["vcuda-whole-2"], KERNEL_ID)
    assert dict(whole.limits) == {"tencent.com/vcuda-core": "200", "tencent.com/vcuda-memory": "128"}
    assert "tencent.com/vcuda-core-limit" not in whole.annotations


def test_vcuda_refuses_a_fraction_that_would_switch_limiting_off() -> None:
    size = profile("vc", gpu_fraction=0.99, memory_mib=8000, compute_percent=100, backend="vcuda")
    with pytest.raises(
        ConfigError, match=re.escape("ElasticKernels.profiles['vc'].compute_percent: 100 would")
    ):
        validate_backend_options(size)
    with pytest.raises(ConfigError, match="vcuda-core: 100"):
        render_pod_fragment(size, KERNEL_ID)
    assert (
        dict(
            render_pod_fragment(
                profile("ok", gpu_fraction=0.99, memory_mib=8000, backend="vcuda"), KERNEL_ID
            ).limits
        )["tencent.com/vcuda-core"]
        == "99"
    )


# -- the validation bites -------------------------------------------------------------------------


def test_strict_validation_rejects_a_misspelled_pod_claim() -> None:
    fragment = render_pod_fragment(CASES["dra-whole-1"], KERNEL_ID)
    name = fragment.side_objects[0]["metadata"]["name"]
    broken = PodFragment(
        pod_resource_claims=({"name": "gpu", "resourceClaimTemplatName": name},),
        container_claims=fragment.container_claims,
    )
    with pytest.raises(kubernetes_validate.ValidationError, match="resourceClaimTemplatName"):
        validate(broken.apply_to(base_pod()))


def test_strict_validation_rejects_a_misplaced_field_in_a_template() -> None:
    _, template = dra_side("dra-mig")
    broken = copy.deepcopy(template)
    request = broken["spec"]["spec"]["devices"]["requests"][0]
    request["deviceClassName"] = request["exactly"].pop("deviceClassName")  # the v1beta1 shape
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    validate(template)


def test_strict_validation_rejects_a_wrong_type() -> None:
    fragment = PodFragment(container_claims=({"name": "gpu", "request": 1},))
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(fragment.apply_to(base_pod()))


def test_fragment_rejects_setting_a_forbidden_variable() -> None:
    with pytest.raises(ValueError, match="CUDA_DISABLE_CONTROL"):
        PodFragment(env={"CUDA_DISABLE_CONTROL": "true"}, forbidden_env=("CUDA_DISABLE_CONTROL",))
