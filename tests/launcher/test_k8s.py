"""deploy/k8s: the manifests parse, and their wiring agrees with the code (they cannot be applied here); so does
deploy/k8s/second-model, a second model's tokenizers, detokenizers and replicas behind the same router."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from libs.protocol import Addresses

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SECOND = K8S / "second-model"
ROLES = ("router", "tokenizer", "detokenizer", "http", "scheduler", "shard")
MODEL_ROLES = ("tokenizer", "detokenizer", "scheduler", "shard")  # what a second model brings


def kustomized(folder: Path) -> list[dict]:
    """The documents of a kustomization that lists every manifest of its folder."""
    listed = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")
    return [d for name in listed for d in yaml.safe_load_all((folder / name).read_text()) if d]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return kustomized(K8S)


@pytest.fixture(scope="module")
def second() -> list[dict]:
    return kustomized(SECOND)


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


def test_replica_pods_drain_with_their_shard_serving(docs, second):
    """SIGTERM drains a replica's scheduler for the graceful termination timeout; its shard's preStop hook waits for
    the scheduler to exit (which it must see: one process namespace), and the grace period covers the timeout. The
    second model's replicas too."""
    from libs.runtime.settings import Settings

    for manifests, name in ((docs, "switchyard-replica"), (second, "switchyard-model-b-replica")):
        pod = find(manifests, "StatefulSet", name)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > Settings().graceful_termination_timeout
        assert pod["shareProcessNamespace"] is True
        shard = {c["name"]: c for c in pod["containers"]}["shard"]
        assert shard["lifecycle"]["preStop"]["exec"]["command"] == ["python", "-m", "services.scheduler.exited"]


def settings_at(docs, container: dict, ordinal: int):
    """The settings a service of `container` runs with in the pod of `ordinal` (libs/runtime/service.py's)."""
    from libs.runtime.service import global_index
    from libs.runtime.settings import Settings

    env = {k: v for k, v in env_of(docs, container).items() if isinstance(v, str)}
    index = env_of(docs, container)["SWITCHYARD_INDEX"]
    assert index == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    role = container["command"][-1].rsplit(".", 1)[1]
    return global_index(role, Settings.from_env({**env, "SWITCHYARD_INDEX": str(ordinal)}))


def test_a_second_model_brings_its_own_tokenizers_detokenizers_and_replicas(docs, second):
    """Each of its containers runs its service with the first model's settings and then its own ConfigMap (listed
    after, so its keys win: the model), and the bus key; it serves another model than the router's, the one it
    resolves (MODEL_ID)."""
    everything = docs + second
    found = containers(second)
    assert set(found) == set(MODEL_ROLES)
    first_model = env_of(docs, containers(docs)["router"][0])["SWITCHYARD_MODEL_ID"]  # the router's: the default
    for role, (c, _) in found.items():
        assert c["command"][-1].endswith(f"exec python -m services.{role}")
        assert [next(iter(src.values()))["name"] for src in c["envFrom"]] == [
            "switchyard-config",
            "switchyard-model-b-config",
            "switchyard-bus",
        ]
        s = settings_at(everything, c, 0)
        assert s.model_id == env_of(everything, c)["MODEL_ID"] and s.model_id != first_model, role


def test_the_second_models_indices_and_ports_come_after_the_firsts(docs, second):
    """Its tokenizers, detokenizers and replicas are numbered after the first model's (any count below the base
    the first is scaled to): no role and index is claimed twice, no replica's ports are another's, and each of its
    shards connects where its own pod's scheduler binds."""
    everything = docs + second
    first, other = containers(docs), containers(second)
    for role in MODEL_ROLES:
        base = settings_at(everything, other[role][0], 0).index
        assert base >= 100
        mine = {settings_at(everything, other[role][0], k).index for k in range(8)}
        theirs = {settings_at(docs, first[role][0], k).index for k in range(base)}
        assert len(mine) == 8 and not mine & theirs, role
    names = ("in", "plan", "results")
    first_bind = Addresses.parse(settings_at(docs, first["scheduler"][0], 0).bus)
    taken = {first_bind.replica(r, name) for r in range(100) for name in names}
    ports = set()
    for k in range(8):
        scheduler = settings_at(everything, other["scheduler"][0], k)
        shard = settings_at(everything, other["shard"][0], k)
        bind, connect = Addresses.parse(scheduler.bus), Addresses.parse(shard.bus)
        replica = scheduler.index
        assert shard.index // shard.num_shard == replica
        for name in names:
            port = bind.replica(replica, name).removeprefix("tcp://0.0.0.0:")
            assert connect.replica(replica, name) == f"tcp://127.0.0.1:{port}"
            ports.add(bind.replica(replica, name))
    assert len(ports) == 8 * len(names) and not ports & taken


def test_each_models_pods_are_selected_by_its_own_workloads_and_services_only(docs, second):
    """No selector of one model's StatefulSets or headless Services takes the other's pods, and each StatefulSet of
    the second model has its headless Service (its pods' DNS names: the replica's announced address)."""
    everything = docs + second
    templates = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in everything
        if "template" in d.get("spec", {})
    }
    for d in everything:
        selector = d.get("spec", {}).get("selector")
        if not selector:
            continue
        selector = selector.get("matchLabels", selector)
        chosen = {name for name, labels in templates.items() if selector.items() <= labels.items()}
        if d["kind"] == "StatefulSet" or d["kind"] == "Deployment":
            assert chosen == {d["metadata"]["name"]}, d["metadata"]["name"]
        else:
            assert len(chosen) == 1, d["metadata"]["name"]
    for d in second:
        if d["kind"] == "StatefulSet":
            service = find(second, "Service", d["spec"]["serviceName"])
            assert service["spec"]["clusterIP"] == "None"
            assert service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
