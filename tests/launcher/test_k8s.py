"""deploy/k8s: the manifests parse, and their wiring agrees with the code (they cannot be applied here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from libs.protocol import Addresses

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
ROLES = ("router", "tokenizer", "detokenizer", "http", "scheduler", "shard")


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    return [d for name in listed for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def find(docs, kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def containers(docs) -> dict[str, tuple[dict, dict]]:
    """container name → (container, its workload)."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                out[c["name"]] = (c, d)
    return out


def env_of(docs, container: dict) -> dict[str, object]:
    """The container's environment: its ConfigMaps, then its own env (which wins, as in Kubernetes)."""
    env = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:  # a Secret is made out of band (deploy/k8s/kustomization.yaml)
            env.update(find(docs, "ConfigMap", src["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def test_one_workload_per_service_running_its_module(docs):
    found = containers(docs)
    assert set(found) == set(ROLES)
    for role, (c, workload) in found.items():
        assert c["command"][-1].endswith(f"exec python -m services.{role}")
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_router_is_one_deployment_behind_a_service_with_the_bus_ports(docs):
    router = find(docs, "Deployment", "switchyard-router")
    assert router["spec"]["replicas"] == 1
    service = find(docs, "Service", "switchyard-router")
    bus = Addresses.parse("tcp://switchyard-router:5550")
    ports = {f"tcp://switchyard-router:{p['port']}" for p in service["spec"]["ports"]}
    assert ports == {bus.intake, bus.tokenize, bus.admit, bus.events_in, bus.events_out}
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()


def test_scaled_roles_have_their_own_replica_counts_and_unique_indices(docs):
    for role in ("tokenizer", "detokenizer", "http"):
        workload = find(docs, "StatefulSet", f"switchyard-{role}")
        assert workload["spec"]["replicas"] >= 1
        [c] = workload["spec"]["template"]["spec"]["containers"]
        index = env_of(docs, c)["SWITCHYARD_INDEX"]
        assert index == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}


def test_http_is_probed_on_health_and_exposed(docs):
    c, _ = containers(docs)["http"]
    for probe in ("readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"  # the process alone: 200 while it drains
    port = int(env_of(docs, c)["SWITCHYARD_PORT"])
    assert c["ports"][0]["containerPort"] == port
    service = find(docs, "Service", "switchyard")
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]


def test_the_bus_addresses_agree(docs):
    """Every process's bus spec parses; the router names no replica (each announces itself: the address its
    scheduler binds on every interface, under the pod's own name), and replica r's shard connects where its
    scheduler binds; nothing ties the replica count to the router's settings."""
    found = containers(docs)
    env = {role: env_of(docs, c) for role, (c, _) in found.items()}
    buses = {role: Addresses.parse(e["SWITCHYARD_BUS"]) for role, e in env.items()}
    assert buses["router"].where == "0.0.0.0" and not buses["router"].replica_hosts  # it binds; no address list
    for role in ("tokenizer", "detokenizer", "http", "scheduler", "shard"):
        assert buses[role].intake == "tcp://switchyard-router:5550" and buses[role].port == buses["router"].port
    assert find(docs, "Service", "switchyard-replica")["spec"]["clusterIP"] == "None"  # per-pod DNS names
    for r in range(8):  # any count kubectl scale sets
        for name in ("in", "plan", "results"):
            port = buses["scheduler"].replica(r, name).removeprefix("tcp://0.0.0.0:")
            assert port.isdigit() and buses["shard"].replica(r, name) == f"tcp://127.0.0.1:{port}"


def test_the_bus_is_curve_with_the_allowed_client_keys_mounted_from_a_secret(docs):
    """Every service refuses a plaintext tcp bus: each container takes the deployment's key from the Secret
    `switchyard-bus`; the binders (router, scheduler) read the client keys they let in from the Secret
    `switchyard-bus-clients`, mounted where SWITCHYARD_CURVE_ALLOWED_KEYS points."""
    for role, (c, workload) in containers(docs).items():
        assert {"secretRef": {"name": "switchyard-bus"}} in c["envFrom"], role
        env = env_of(docs, c)
        assert "SWITCHYARD_BUS_INSECURE" not in env
        if role in ("router", "scheduler"):
            path = env["SWITCHYARD_CURVE_ALLOWED_KEYS"]
            [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert mount["readOnly"]
            [volume] = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
            assert volume["secret"]["secretName"] == "switchyard-bus-clients"
        else:
            assert "SWITCHYARD_CURVE_ALLOWED_KEYS" not in env


def test_http_pods_drain_within_their_grace_period(docs):
    """SIGTERM drains http for the graceful termination timeout: the grace period covers the preStop pause and it."""
    from libs.runtime.settings import Settings

    pod = find(docs, "StatefulSet", "switchyard-http")["spec"]["template"]["spec"]
    [http] = pod["containers"]
    pause = float(http["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pause + Settings().graceful_termination_timeout
    assert http["readinessProbe"]["httpGet"]["path"] == "/health"


def test_replica_pods_drain_with_their_shard_serving(docs):
    """SIGTERM drains a replica's scheduler for the graceful termination timeout; its shard's preStop hook waits for
    the scheduler to exit (which it must see: one process namespace), and the grace period covers the timeout."""
    from libs.runtime.settings import Settings

    pod = find(docs, "StatefulSet", "switchyard-replica")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > Settings().graceful_termination_timeout
    assert pod["shareProcessNamespace"] is True
    shard = {c["name"]: c for c in pod["containers"]}["shard"]
    assert shard["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-m", "services.scheduler.exited"]
