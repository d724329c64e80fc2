"""The Kubernetes manifests and the image recipe, checked offline: every overlay renders with
`kubectl kustomize`, every object validates against the Kubernetes OpenAPI schemas, the config in the
ConfigMap is a valid tiercake config, and the properties a production deployment depends on hold."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from paths import ROOT, shm_file
from pydantic import ByteSize, TypeAdapter

from tiercake.config import TiercakeConfig
from tiercake.tiers.pool import remove_pool

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "gpu", "external-etcd", "vllm")


def compute(overlay: str) -> tuple[str, ...]:
    """The Deployments that compute: tiercake's own workers, or vLLM's servers in the vllm overlay."""
    return ("tiercake-vllm",) if overlay == "vllm" else ("tiercake-prefill", "tiercake-decode")


KUBERNETES_VERSION = "1.32.0"
TIERCAKE_PODS = {"app.kubernetes.io/part-of": "tiercake"}


def kubectl() -> str:
    """kubectl with kustomize v5 (Kubernetes 1.27 or newer): older ones cannot read these kustomizations."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("the deployment tests need kubectl 1.27+ (kustomize v5): https://kubernetes.io/docs/tasks/tools/")
    version = subprocess.run([found, "version", "--client"], capture_output=True, text=True, timeout=30).stdout
    if not re.search(r"Kustomize Version: v[5-9]", version):
        pytest.fail(f"the deployment tests need kubectl 1.27+ (kustomize v5); {found} says: {version.strip()}")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay rendered, from a copy where the gpu overlay's untracked secret files are made
    from their examples (as an operator would)."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    for example in (tree / "overlays").glob("*/*.example"):
        shutil.copy(example, example.with_name(example.name.removesuffix(".example")))
    out = {}
    for overlay in OVERLAYS:
        done = subprocess.run(
            [kubectl(), "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{overlay}: {done.stderr}"
        out[overlay] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = find(docs, kind, name)
    return found


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def config_of(docs: list[dict]) -> tuple[TiercakeConfig, dict]:
    (cm,) = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"].startswith("tiercake-config")]
    raw = yaml.safe_load(cm["data"]["config.yaml"])
    return TiercakeConfig.model_validate(raw), raw


def container(workload: dict, name: str | None = None) -> dict:
    """The pod's container called ``name``, else its main one (the first: a sidecar follows it)."""
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        return containers[0]
    (c,) = [c for c in containers if c["name"] == name]
    return c


def port_of(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


# Rendering and schemas ----------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, overlay):
    docs = rendered[overlay]
    assert len(docs) > 10
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.cluster
def test_the_schema_check_catches_a_wrong_field(rendered):
    """A negative control: the validator does reject a mistyped or misplaced field."""
    broken = yaml.safe_load(yaml.safe_dump(one(rendered["dev"], "Deployment", "tiercake-conductor")))
    container(broken)["ports"][0]["containerPort"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(one(rendered["dev"], "Deployment", "tiercake-conductor")))
    container(broken)["readinesProbe"] = container(broken).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.cluster
def test_a_missing_secret_file_is_a_clear_render_error(tmp_path):
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    for untracked in ("secrets.env", "api-keys.yaml"):
        (tree / "overlays" / "gpu" / untracked).unlink(missing_ok=True)
    done = subprocess.run(
        [kubectl(), "kustomize", str(tree / "overlays" / "gpu")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "secrets.env" in done.stderr


# The config ---------------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configmap_holds_a_valid_tiercake_config_that_matches_the_manifests(rendered, overlay):
    docs = rendered[overlay]
    config, _ = config_of(docs)
    conductor = container(one(docs, "Deployment", "tiercake-conductor"))
    node = container(one(docs, "DaemonSet", "tiercake-node"))
    assert config.conductor.port == port_of(conductor, "control")
    assert config.serving.port == port_of(conductor, "api") != config.conductor.port
    assert config.transfer.port == port_of(node, "transfer") and config.transfer.host == "0.0.0.0"
    control = one(docs, "Service", "tiercake-conductor")["spec"]["ports"][0]["port"]
    assert config.conductor.urls == [f"http://tiercake-conductor:{control}"]
    # the mounted paths the config names exist in the pods that use them
    mounts = {m["mountPath"] for m in node["volumeMounts"]}
    for tier in config.store.tiers:
        assert any(Path(tier.path).is_relative_to(m) for m in mounts - {"/"}), tier.path
    assert any(m["mountPath"] == str(Path(config.serving.api_keys_file).parent) for m in conductor["volumeMounts"])
    # leader election through etcd: every conductor replica runs on the same etcd
    assert config.conductor.etcd and config.conductor.leader_ttl > 0
    statefulsets = find(docs, "StatefulSet", "tiercake-etcd")
    if overlay == "external-etcd":
        assert not statefulsets and not find(docs, "Service", "tiercake-etcd")
        assert all("tiercake-etcd" not in e for e in config.conductor.etcd)
    else:
        (etcd,) = statefulsets
        members = [f"tiercake-etcd-{i}.tiercake-etcd:2379" for i in range(etcd["spec"]["replicas"])]
        assert config.conductor.etcd == members


@pytest.mark.cluster
def test_overlay_configs_stay_in_step_with_the_base_config(rendered):
    base = yaml.safe_load((K8S / "base" / "config.yaml").read_text())
    assert config_of(rendered["gpu"])[1] == base
    external = config_of(rendered["external-etcd"])[1]
    assert {**external, "conductor": {**external["conductor"], "etcd": base["conductor"]["etcd"]}} == base


# The properties of the deployment -----------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged_with_probes_and_limits(rendered, overlay):
    for w in workloads(rendered[overlay]):
        name = w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, name
        assert pod["automountServiceAccountToken"] is False, name
        for c in pod["containers"] + pod.get("initContainers", []):
            cs = c["securityContext"]
            assert cs["allowPrivilegeEscalation"] is False and cs["readOnlyRootFilesystem"] is True, name
            assert cs["capabilities"]["drop"] == ["ALL"], name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)
            assert "livenessProbe" in c and "readinessProbe" in c, name


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_conductors_are_replicated_behind_readiness_and_scraped(rendered, overlay):
    docs = rendered[overlay]
    deployment = one(docs, "Deployment", "tiercake-conductor")
    assert deployment["spec"]["replicas"] >= 2
    c = container(deployment)
    # ready on the public port: a leader is known and a worker can serve (no completion meets a 503);
    # under vLLM too, where the workers stand for the vLLM servers
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "api"}
    assert "$(POD_NAME)" in c["args"]  # each replica its own id in the election
    env = {e["name"]: e for e in c["env"]}
    assert env["TIERCAKE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port_of(c, "control")
    # members register through the control Service before any conductor is ready: it must reach them
    assert one(docs, "Service", "tiercake-conductor")["spec"]["publishNotReadyAddresses"] is True
    assert not one(docs, "Service", "tiercake-api")["spec"].get("publishNotReadyAddresses")
    pdb = one(docs, "PodDisruptionBudget", "tiercake-conductor")
    assert pdb["spec"]["minAvailable"] >= 1


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_tiercake_process_is_annotated_for_scraping_on_a_port_it_serves(rendered, overlay):
    docs = rendered[overlay]
    config, _ = config_of(docs)
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/part-of") != "tiercake" or labels["app.kubernetes.io/component"] == "etcd":
            continue
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        name = w["metadata"]["name"]
        assert annotations.get("prometheus.io/scrape") == "true" and annotations["prometheus.io/path"] == "/metrics", (
            name
        )
        assert int(annotations["prometheus.io/port"]) in {p["containerPort"] for p in container(w)["ports"]}, name
    node = one(docs, "DaemonSet", "tiercake-node")
    assert (
        int(node["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) == config.transfer.metrics_port
    )


@pytest.mark.cluster
def test_the_prometheus_operator_component_monitors_every_process(tmp_path):
    """The optional component, added to the dev overlay as its comment says: a PodMonitor whose
    endpoints name ports every kind of tiercake pod has."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    site = tree / "overlays" / "dev"
    with (site / "kustomization.yaml").open("a") as kustomization:
        kustomization.write("components:\n  - ../../components/prometheus-operator\n")
    done = subprocess.run([kubectl(), "kustomize", str(site)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    (monitor,) = find(docs, "PodMonitor")
    assert monitor["metadata"]["namespace"] == "tiercake-dev"
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        if not _selects(monitor["spec"]["selector"], labels) or labels["app.kubernetes.io/component"] == "etcd":
            continue
        annotated = int(w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
        named = {p["name"] for p in container(w)["ports"] if p["containerPort"] == annotated}
        assert named & ports, (w["metadata"]["name"], named, ports)


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", ("dev", "gpu"))
def test_etcd_is_three_members_on_persistent_volumes(rendered, overlay):
    docs = rendered[overlay]
    etcd = one(docs, "StatefulSet", "tiercake-etcd")
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["serviceName"] == "tiercake-etcd"
    assert etcd["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    args = " ".join(container(etcd)["args"])
    initial = re.search(r"--initial-cluster=(\S+)", args).group(1).split(",")
    assert initial == [f"tiercake-etcd-{i}=http://tiercake-etcd-{i}.tiercake-etcd:2380" for i in range(3)]
    assert one(docs, "Service", "tiercake-etcd")["spec"]["clusterIP"] == "None"
    assert one(docs, "PodDisruptionBudget", "tiercake-etcd")["spec"]["minAvailable"] == 2
    # etcd lets clients ping at most this often; tiercake's backend pings each KEEPALIVE_MS to notice
    # a member cut off (etcd's default, 5 s, answers such pings with GOAWAY "too many pings")
    from tiercake.conductor.etcd import KEEPALIVE_MS

    min_time = re.search(r"--grpc-keepalive-min-time=(\d+)ms", args)
    assert min_time and int(min_time.group(1)) < KEEPALIVE_MS, args


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_agents_and_workers_share_the_pool_and_the_node_id(rendered, overlay):
    docs = rendered[overlay]
    config, _ = config_of(docs)
    (pool,) = [t for t in config.store.tiers if t.kind == "pool"]
    assert pool.path.startswith("/dev/shm/")
    node = one(docs, "DaemonSet", "tiercake-node")
    workers = [one(docs, "Deployment", name) for name in compute(overlay)]
    for w in [node, *workers]:
        pod = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in container(w)["volumeMounts"]}
        assert mounted["/dev/shm"]["hostPath"]["path"] == "/dev/shm", w["metadata"]["name"]
        env = {e["name"]: e for e in container(w)["env"]}
        assert env["TIERCAKE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the pool's pages are charged to the agent that faults them in: its memory limit holds the pool
    limit = TypeAdapter(ByteSize).validate_python(container(node)["resources"]["limits"]["memory"].replace("i", "iB"))
    assert limit > pool.capacity
    for w in workers:  # many replicas on one machine: ids from the pod, not the node
        assert overlay == "vllm" or "$(POD_NAME)" in container(w)["args"]
        assert container(w)["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.cluster
def test_gpu_workers_request_gpus_and_dev_workers_none(rendered):
    for overlay, gpus in (("gpu", 1), ("external-etcd", 1), ("dev", 0)):
        for role in ("prefill", "decode"):
            w = one(rendered[overlay], "Deployment", f"tiercake-{role}")
            resources = container(w)["resources"]
            assert int(resources["limits"].get("nvidia.com/gpu", 0)) == gpus, (overlay, role)
            assert container(w)["image"].endswith("cuda" if gpus else ":cpu")
            if gpus:
                pod = w["spec"]["template"]["spec"]
                assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


@pytest.mark.cluster
def test_the_vllm_overlay_runs_vllm_with_the_connector_as_serve_command_builds_it(rendered, monkeypatch):
    """The vllm overlay: vLLM servers (one GPU each, on the node pool through /dev/shm) started with
    exactly the line ``serve_command`` builds (the one the README prints), saving to the agent of
    their machine; beside each, a tiercake worker standing for it; tiercake's own workers are left
    out; clients call the front, which tokenizes with the model's tokenizer; vLLM's port is closed."""
    import json as json_

    from tiercake.config import with_environment
    from tiercake.workers.vllm.process import serve_command

    docs = rendered["vllm"]
    assert not [w for w in workloads(docs) if w["metadata"]["name"] in ("tiercake-prefill", "tiercake-decode")]
    vllm = one(docs, "Deployment", "tiercake-vllm")
    c = container(vllm, "vllm")
    args = c["args"]
    expected = serve_command(
        "/models/model",
        "model",
        8000,
        "http://tiercake-conductor:8081",
        "$(TIERCAKE_NODE_ID)",
        host="0.0.0.0",
        kv_events=(5557, 5558),
    )
    assert [*c["command"], *args] == ["python3", *expected[expected.index("-m") :]]
    transfer = json_.loads(args[args.index("--kv-transfer-config") + 1])
    events = json_.loads(args[args.index("--kv-events-config") + 1])  # to the worker, over the pod's loopback
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["replay_endpoint"].startswith(
        "tcp://127.0.0.1:"
    )
    assert transfer["kv_connector_extra_config"]["node"] == "$(TIERCAKE_NODE_ID)"  # expanded by the kubelet
    env = {e["name"]: e for e in c["env"]}
    assert env["TIERCAKE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    config, _ = config_of(docs)
    assert transfer["kv_connector_extra_config"]["conductor"].endswith(f":{config.conductor.port}")

    # the worker beside vLLM: talks to it over the pod's loopback, waits for it, serves the front
    worker = container(vllm, "worker")
    wargs = worker["args"]
    assert wargs[:2] == ["worker", "--engine"] and wargs[wargs.index("--engine") + 1] == "vllm"
    assert wargs[wargs.index("--vllm-url") + 1] == "http://127.0.0.1:8000" and "--vllm-wait" in wargs
    listen = int(wargs[wargs.index("--listen") + 1].rsplit(":", 1)[1])
    assert port_of(worker, "worker") == listen and "$(POD_NAME)" in wargs
    assert worker["readinessProbe"]["httpGet"]["port"] == "worker"

    # clients reach the front only: no Service for vLLM, its port open to Prometheus alone
    assert not find(docs, "Service", "tiercake-vllm")
    policy = one(docs, "NetworkPolicy", "tiercake-vllm")
    peers = _policy_ports(policy)
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert peers[8000] == [monitoring]
    assert {
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") for p in peers[listen]
    } == {"conductor", None} and monitoring in peers[listen]

    # the front names the model as vLLM serves it and tokenizes with its tokenizer, from the volume
    conductor = container(one(docs, "Deployment", "tiercake-conductor"))
    cenv = {e["name"]: e.get("value") for e in conductor["env"]}
    for name, value in cenv.items():
        if name.startswith("TIERCAKE__"):
            monkeypatch.setenv(name, value)
    front = with_environment(config)
    assert front.model_id == "model" and front.serving.tokenizer == "/models/model"
    assert "/models" in {m["mountPath"] for m in conductor["volumeMounts"]}
    assert conductor["image"] == container(vllm, "vllm")["image"]  # the image with the tokenizer libraries


def _policy_ports(policy: dict) -> dict[int, list]:
    """Port -> the ``from`` peers allowed (an empty list: everyone)."""
    out: dict[int, list] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            out[port["port"]] = rule.get("from", [])
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_open_the_api_and_keep_the_control_and_transfer_ports_internal(rendered, overlay):
    docs = rendered[overlay]
    config, _ = config_of(docs)
    policies = {p["metadata"]["name"]: p for p in find(docs, "NetworkPolicy")}
    conductor = _policy_ports(policies["tiercake-conductor"])
    assert conductor[config.serving.port] == []  # the public API
    own_pods = {"podSelector": {"matchLabels": TIERCAKE_PODS}}
    control_peers = conductor[config.conductor.port]
    assert own_pods in control_peers
    assert all(
        "podSelector" in p
        and p["podSelector"]["matchLabels"] == TIERCAKE_PODS
        or p == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        for p in control_peers
    )
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert _policy_ports(policies["tiercake-node"]) == {
        config.transfer.port: [own_pods],
        config.transfer.metrics_port: [monitoring],
    }
    workers = policies["tiercake-workers"]
    assert _policy_ports(workers) == {
        8000: [
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": "tiercake", "app.kubernetes.io/component": "conductor"}
                }
            },
            monitoring,
        ]
    }
    # every port any tiercake pod listens on is covered by a policy selecting that pod
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in policies.values() if _selects(p["spec"]["podSelector"], labels)]
        assert covering, w["metadata"]["name"]
        allowed = {port for p in covering for port in _policy_ports(p)}
        assert {p["containerPort"] for p in container(w)["ports"]} <= allowed, w["metadata"]["name"]
    if overlay != "external-etcd":
        etcd = _policy_ports(policies["tiercake-etcd"])
        assert etcd[2379] == [
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": "tiercake", "app.kubernetes.io/component": "conductor"}
                }
            }
        ]


def raw_port(docs: list[dict], workload: str) -> int:
    """The port a workload's pods are annotated to be scraped on."""
    (w,) = [w for w in workloads(docs) if w["metadata"]["name"] == workload]
    return int(w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.cluster
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_and_secrets_point_at_what_exists(rendered, overlay):
    docs = rendered[overlay]
    templates = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)]
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in find(docs, kind):
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            assert any(_selects({"matchLabels": selector}, labels) for labels in templates), obj["metadata"]["name"]
    budgets = {p["metadata"]["name"] for p in find(docs, "PodDisruptionBudget")}
    assert {"tiercake-conductor", "tiercake-node", *compute(overlay)} <= budgets
    (secret,) = find(docs, "Secret")
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        for e in container(w).get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"], e["name"]
        for v in pod.get("volumes", []):
            if "secret" in v:
                assert {i["key"] for i in v["secret"]["items"]} <= set(secret["data"])


# The image ----------------------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_non_root_with_cpu_and_cuda_variants():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, re.M)
    assert stages == ["build", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    user = re.search(r"^USER (\S+)$", runtime, re.M).group(1)
    assert user.split(":")[0] not in ("0", "root")
    assert re.search(r'^ENTRYPOINT \["tiercake"\]$', runtime, re.M)
    assert "COPY --from=build /opt/tiercake /opt/tiercake" in runtime
    assert re.search(r"^\s+cpu\) index=", text, re.M) and re.search(r"^\s+cuda\) index=", text, re.M)
    assert "ARG VARIANT=cpu" in text


def test_the_vllm_image_installs_what_the_tiercake_image_does():
    """deploy/vllm.Dockerfile (the vllm overlay's image): the same sources as the tiercake image,
    installed over vLLM's own torch, checked with pip check and an import of the connector."""

    def copies(name: str) -> list[str]:
        return re.findall(r"^COPY (?!--from)(.+)$", (ROOT / "deploy" / name).read_text(), re.M)

    assert copies("vllm.Dockerfile") == copies("Dockerfile")
    text = (ROOT / "deploy" / "vllm.Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.0\b", text, re.M)  # the vLLM CI tests with
    assert "pip check" in text and "import tiercake.workers.vllm.connector" in text


@pytest.mark.cluster
def test_the_build_context_builds_the_whole_package(tmp_path):
    """What the Dockerfile copies (and .dockerignore lets through) builds a wheel with every module."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = [s for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for s in line.split()[:-1]]
    allowed = {
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    assert set(copied) <= allowed, set(copied) - allowed
    context = tmp_path / "src"
    context.mkdir()
    for source in copied:
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, context / source)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("tiercake-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("tiercake", "conductor", "tiers", "transfer", "workers", "policies"):
        prefix = "tiercake/" if part == "tiercake" else f"tiercake/{part}/"
        for source in (ROOT / part).rglob("*.py"):
            relative = source.relative_to(ROOT / part).as_posix()
            assert prefix + relative in names, prefix + relative


# The manifests' commands, run ----------------------------------------------------------------------


def _pod_env(c: dict, pod: str, node: str, secret: dict[str, str]) -> dict[str, str]:
    """A container's environment as Kubernetes would give it: field refs and secret keys resolved."""
    fields = {"metadata.name": pod, "spec.nodeName": node, "status.podIP": "127.0.0.1"}
    env = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "fieldRef" in source:
            env[e["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[e["name"]] = secret[source["secretKeyRef"]["key"]]
        else:
            env[e["name"]] = e["value"]
    return env


@pytest.mark.cluster
async def test_the_dev_overlay_runs_as_processes(rendered, tmp_path):
    """The rendered dev overlay's own commands, environment, config and secrets, run as processes on
    this machine (a real etcd; ports, paths and addresses moved onto it): the workers and the node agent
    join the conductor with the Secret's token, the probes answer, and a completion with an API key
    from the Secret is served and reused."""
    import base64
    import os
    import socket

    import aiohttp

    from tiercake.conductor.client import Client
    from tiercake.conductor.etcd_process import EtcdCluster, free_port
    from tiercake.up import Child

    docs = rendered["dev"]
    (secret_obj,) = find(docs, "Secret")
    secret = {k: base64.b64decode(v).decode() for k, v in secret_obj["data"].items()}
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "api-keys.yaml").write_text(secret["api-keys.yaml"])
    _, raw = config_of(docs)
    pool = str(shm_file(f"deploy-test-{os.getpid()}"))
    etcd = EtcdCluster(tmp_path / "etcd").start()
    ports = {name: free_port() for name in ("control", "api", "transfer", "metrics")}
    raw["store"]["tiers"][0]["path"] = pool
    raw["store"]["tiers"][1]["path"] = str(tmp_path / "ssd")
    raw["conductor"].update(
        host="127.0.0.1", port=ports["control"], etcd=etcd.endpoints, urls=[f"http://127.0.0.1:{ports['control']}"]
    )
    raw["serving"].update(
        host="127.0.0.1", port=ports["api"], gpu_blocks=128, api_keys_file=str(tmp_path / "secrets" / "api-keys.yaml")
    )
    raw["transfer"].update(host="127.0.0.1", port=ports["transfer"], metrics_port=ports["metrics"])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    children: list[Child] = []

    def start(workload: str, pod: str) -> Child:
        c = container(next(w for w in workloads(docs) if w["metadata"]["name"] == workload))
        args = [
            a.replace("$(POD_NAME)", pod).replace("/etc/tiercake/config/config.yaml", str(config)) for a in c["args"]
        ]
        args = [("127.0.0.1:0" if a.startswith("0.0.0.0:") else a) for a in args]
        args = [(str(tmp_path / pod) if a == "/var/lib/tiercake" else a) for a in args]
        env = {**os.environ, **_pod_env(c, pod, "node-a", secret)}
        child = Child(pod, args, env, tmp_path / "logs")
        children.append(child)
        return child

    try:
        start("tiercake-conductor", "tiercake-conductor-0").wait_announce(60)
        start("tiercake-node", "tiercake-node-x1").wait_announce(60)
        workers = [start(f"tiercake-{role}", f"tiercake-{role}-0") for role in ("prefill", "decode")]
        urls = [w.wait_announce(300)["url"] for w in workers]
        control = f"http://127.0.0.1:{ports['control']}"
        api = f"http://127.0.0.1:{ports['api']}"
        token = secret["control-tokens"].split()[0]
        async with Client([control], token=token, timeout=30) as client:
            for _ in range(100):  # joined with the Secret's token, under the node's name
                roles = {m.role: m for m in await client.members()}
                if {"node", "prefill", "decode"} <= set(roles):
                    break
                await asyncio.sleep(0.2)
            assert roles["node"].node_id == "node-a" and roles["prefill"].node_id == "tiercake-prefill-0"
        conductor = container(one(docs, "Deployment", "tiercake-conductor"))
        worker = container(one(docs, "Deployment", "tiercake-prefill"))
        async with aiohttp.ClientSession() as http:
            for probe in ("readinessProbe", "livenessProbe"):
                path, port = conductor[probe]["httpGet"]["path"], conductor[probe]["httpGet"]["port"]
                for _ in range(50):  # without a token, as kubelet asks; ready once a worker can serve
                    async with http.get({"api": api, "control": control}[port] + path) as resp:
                        status, text = resp.status, await resp.text()
                    if status == 200:
                        break
                    await asyncio.sleep(0.2)
                assert status == 200, (probe, text)
            for url in urls:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    async with http.get(url + worker[probe]["httpGet"]["path"]) as resp:
                        assert resp.status == 200, probe
        with socket.create_connection(("127.0.0.1", ports["transfer"]), timeout=5):
            pass  # the node agent's tcpSocket probe
        # each process scraped as its annotations say, without a token (as Prometheus does)
        moved = {
            raw_port(docs, "tiercake-conductor"): [control],
            raw_port(docs, "tiercake-node"): [f"http://127.0.0.1:{ports['metrics']}"],
            raw_port(docs, "tiercake-prefill"): urls,
        }
        async with aiohttp.ClientSession() as http:
            for name, bases in moved.items():
                for base in bases:
                    async with http.get(base + "/metrics") as resp:
                        assert resp.status == 200 and "tiercake_" in await resp.text(), (name, base)
        alice = next(k for k, tenant in yaml.safe_load(secret["api-keys.yaml"]).items() if tenant == "alice")
        prompt = "Kubernetes pods share the node pool through /dev/shm. " * 3
        async with Client([api], token=alice, timeout=120) as client:
            first = await client.complete(prompt, max_tokens=4)
            second = await client.complete(prompt, max_tokens=4)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt.encode()) // 16 * 16 - 16
        async with Client([api], token="sk-not-a-key", timeout=30, retries=1) as stranger:
            with pytest.raises(Exception) as refused:
                await stranger.complete(prompt, max_tokens=1)
            assert getattr(refused.value, "status", None) == 401
    finally:
        for child in reversed(children):
            child.stop()
        etcd.stop()
        remove_pool(pool)
