"""The Helm chart (deploy/helm/ballast), rendered by Helm itself and held to Kubernetes and the code.

No cluster and no helm binary: helm-python-sdk binds Helm v4's own Go SDK (a shared library
in its wheel), so templates render offline exactly as `helm template` would, hooks included.
For each values file (values.yaml with the secrets an install passes, and the two scenario
files), every manifest is validated against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: an unknown field fails) for the oldest Kubernetes the chart supports and the newest the
validator knows. Then what the schemas cannot see: every container runs a `ballast` command the
CLI's parser accepts; every BALLAST_* variable is a setting; every TEMPORAL_* one changes the
Temporal SDK's profile; secrets arrive only through Secret references and no values file holds
one; the api's probes ask paths the FastAPI app serves without a key; each pool has its own
engine Deployment with its model and GPUs; and each process gets what ballast/topology.py, the
contract compose and the multi-host harness are held to, says it needs.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from temporalio.envconfig import ClientConfigProfile

from api.services.auth import PROTECTED
from ballast import topology
from config import Settings
from tests.deploy.test_compose import SECRET_NAME, cli_accepts, settings_env_names

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "ballast"
VALUES_FILES = sorted(p.name for p in CHART.glob("values*.yaml"))
RELEASE, NAMESPACE = "ballast", "llm"

# What `helm install --set-string ...` passes: the secrets no values file may hold.
OWNER_URL = "postgresql://ballast:owner-pw@pg.example:5432/ballast"
KINDS = ("api", "control", "engine")
ROLE_URL = {k: f"postgresql://ballast_{k}:{k}-pw@pg.example:5432/ballast" for k in KINDS}
INSTALL = {
    "database": {"owner": {"url": OWNER_URL, **{f"{k}Password": f"{k}-pw" for k in KINDS}},
                 "service": {f"{k}Url": ROLE_URL[k] for k in KINDS}},
    "engineToken": {"value": "engine-token"},
    "metricsToken": {"value": "metrics-token"},
}
# The Secrets' values, where the operator names Secrets of their own (existingSecret).
EXISTING: dict[tuple[str, ...], str] = {("database", "owner", "urlKey"): OWNER_URL,
                                         **{("database", "owner", f"{k}PasswordKey"): f"{k}-pw" for k in KINDS},
                                         **{("database", "service", f"{k}UrlKey"): ROLE_URL[k] for k in KINDS},
                                                                      ("engineToken", "key"): "engine-token",
                                         ("metricsToken", "key"): "metrics-token",
                                         ("temporal", "apiKey", "key"): "temporal-api-key"}
# The values that are secrets: empty in every values file.
SECRET_VALUES = [("database", "owner", "url"), *[("database", "owner", f"{k}Password") for k in KINDS],
                 *[("database", "service", f"{k}Url") for k in KINDS],
                 ("engineToken", "value"), ("metricsToken", "value"), ("temporal", "apiKey", "value"),
                 ("temporal", "tls", "clientCert"), ("temporal", "tls", "clientKey"), ("temporal", "tls", "serverCA")]
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)  # type: ignore[assignment]
    return d


def _load(name: str) -> dict:
    return yaml.safe_load((CHART / name).read_text()) or {}


def _user_values(values_file: str) -> dict:
    """What an install passes: the file (values.yaml is the defaults) and the secrets."""
    return _merge({} if values_file == "values.yaml" else _load(values_file), INSTALL)


def _effective(user: dict) -> dict:
    return _merge(_load("values.yaml"), user)


def render(user: dict) -> list[dict]:
    """Every manifest `helm template` renders from these user values, hooks included."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(user, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@cache
def _rendered(values_file: str) -> tuple[dict, ...]:
    return tuple(render(_user_values(values_file)))


@pytest.fixture(params=VALUES_FILES)
def case(request) -> tuple[str, dict, list[dict]]:
    """(values file, the effective values, its manifests)."""
    return request.param, _effective(_user_values(request.param)), copy.deepcopy(list(_rendered(request.param)))


# --- reading the manifests --------------------------------------------------------------------


def _workloads(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(workload, its pod spec) for every Deployment and Job."""
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            yield d, d["spec"]["template"]["spec"]


def _containers(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(process name as ballast/topology.py has it, container, pod spec) for each Ballast container."""
    for d, pod in _workloads(docs):
        component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in pod["containers"]:
            if c["name"] == "engine":
                yield f"engine-{d['metadata']['labels']['ballast.dev/pool']}", c, pod
            else:
                yield component, c, pod


def _secret_data(docs: list[dict], values: dict) -> dict[tuple[str, str], str]:
    """Every (Secret, key) a container may name: the chart's, and the operator's own."""
    data = {(d["metadata"]["name"], k): v for d in docs if d["kind"] == "Secret"
            for k, v in (d.get("stringData") or {}).items()}
    for path, value in EXISTING.items():
        secret = _get(values, (*path[:-1], "existingSecret"))
        if secret:
            data[(secret, _get(values, path))] = value
    return data


def _env(container: dict, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: Secret references looked up,
    the downward API faked, $(VAR) expanded."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), str(e["value"]))
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            value = secrets[(ref["name"], ref["key"])]
        else:
            value = "10.0.0.7"  # fieldRef: status.podIP
        env[e["name"]] = value
    return env


def _deployments(docs: list[dict], component: str) -> list[dict]:
    return [d for d in docs if d["kind"] == "Deployment"
            and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]


# --- the tests ------------------------------------------------------------------------------


def test_the_values_files_are_the_three_expected():
    assert VALUES_FILES == ["values-spot-gpu.yaml", "values-temporal-cloud-managed-pg.yaml", "values.yaml"]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_helm_lints_the_chart(values_file):
    report = helm.lint(CHART, _user_values(values_file), namespace=NAMESPACE)
    assert not report["errors"], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_manifest_is_valid_kubernetes(case, kube_version):
    _, _, docs = case
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Job", "ServiceAccount"} <= kinds, kinds
    for d in docs:
        if d["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's own kind, not Kubernetes': test_keda_scales_one_pool_per_model reads it
        try:
            kubernetes_validate.validate(d, kube_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} on Kubernetes {kube_version}: {err}")


def test_every_container_runs_a_ballast_subcommand(case):
    _, _, docs = case
    seen = set()
    for name, c, _ in _containers(docs):
        process = topology.PROCESSES[topology.kind(name) or name]
        assert c["command"] == ["ballast"], f"{name}: {c['command']}"
        assert cli_accepts(c["args"]) is not None, f"{name}: `ballast {' '.join(c['args'])}` is not a command"
        assert tuple(c["args"]) == process.command, name
        seen.add(topology.kind(name))
    assert seen == set(topology.PROCESSES), seen


def test_every_variable_is_a_setting_or_the_temporal_sdks(case):
    _, values, docs = case
    known = settings_env_names()
    secrets = _secret_data(docs, values)
    for name, c, _ in _containers(docs):
        env = _env(c, secrets)
        for key in env:
            if key.startswith("BALLAST_"):
                assert key in known, f"{name}: {key} is not a setting of config.Settings"
        # Each TEMPORAL_* variable is one the SDK's environment configuration reads: without
        # it, the profile Ballast connects with is another.
        temporal = {k: v for k, v in env.items() if k.startswith("TEMPORAL_")}
        full = ClientConfigProfile.load(disable_file=True, override_env_vars=temporal).to_dict()
        for key in temporal:
            less = {k: v for k, v in temporal.items() if k != key}
            assert ClientConfigProfile.load(disable_file=True, override_env_vars=less).to_dict() != full, \
                f"{name}: {key} is not a variable of the Temporal SDK's configuration"


def test_each_process_gets_what_the_contract_says(case):
    """ballast/topology.py over the whole release: every process there, each with what it
    needs and not what it must not have (no engine token on the control worker), the api and
    the workers each logged in as its own role, migrate as the owner, one model and one set
    of meeting places (pools may load the model from elsewhere, under the same name)."""
    _, values, docs = case
    secrets = _secret_data(docs, values)
    envs = {name: _env(c, secrets) for name, c, _ in _containers(docs)}
    assert topology.problems(envs, exact_model=False) == []


def test_long_running_processes_never_see_the_owners_secret(case):
    _, values, docs = case
    owner = docs_owner = values["database"]["owner"]["existingSecret"] or f"{RELEASE}-db-owner"
    for name, c, pod in _containers(docs):
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                if "secretKeyRef" in e.get("valueFrom", {})}
        refs |= {v["secret"]["secretName"] for v in pod.get("volumes") or [] if "secret" in v}
        refs |= {s["secretRef"]["name"] for s in c.get("envFrom") or [] if "secretRef" in s}
        if name == "migrate":
            assert owner in refs
        else:
            assert docs_owner not in refs, f"{name} is handed the owner's Secret"
            env = _env(c, _secret_data(docs, values))
            kind = topology.kind(name) or name
            assert env["BALLAST_DATABASE_URL"] == env["BALLAST_SERVICE_DATABASE_URL"] == ROLE_URL[kind], name
            # Its own role's URL alone: another service's is another's login.
            keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c.get("env") or []
                    if "secretKeyRef" in e.get("valueFrom", {})}
            others = {values["database"]["service"][f"{k}UrlKey"] for k in KINDS if k != kind}
            assert not keys & others, (name, keys)


def test_secrets_arrive_only_through_secret_references(case):
    _, _, docs = case
    for name, c, _ in _containers(docs):
        for e in c.get("env") or []:
            if e["name"] in topology.SECRET_ENV or SECRET_NAME.search(e["name"]):
                assert "secretKeyRef" in e.get("valueFrom", {}), f"{name}: {e['name']} is not from a Secret"
        for source in c.get("envFrom") or []:
            assert set(source) == {"secretRef"}, f"{name}: envFrom {source}"
    assert not [d for d in docs if d["kind"] == "ConfigMap"], "a ConfigMap would be readable without Secret RBAC"


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_no_values_file_holds_a_secret(values_file):
    text = (CHART / values_file).read_text()
    values = _load(values_file)
    for path in SECRET_VALUES:
        assert not _get(values, path), f"{values_file}: {'.'.join(path)} is set"
    assert not re.search(r"://[^/\s:@]+:[^@\s/]+@", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#"))), "a URL with a password"
    assert "PRIVATE KEY" not in text


def test_without_the_secrets_the_chart_refuses_to_render():
    """As compose's ${VAR:?}: an install that forgets one fails, naming it."""
    for path in (("database", "owner", "url"), ("database", "owner", "enginePassword"),
                 ("database", "service", "controlUrl"), ("engineToken", "value"), ("metricsToken", "value")):
        user = copy.deepcopy(INSTALL)
        _get(user, path[:-1]).pop(path[-1])
        with pytest.raises(helm.HelmError, match=re.escape(".".join(path))):
            render(user)


def test_the_api_probes_paths_the_app_serves_without_a_key(case):
    from fastapi.routing import APIRoute

    from api.app import create_app

    _, values, docs = case
    app = create_app(Settings())
    open_gets = {r.path for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods
                 and not (r.path + "/").startswith(PROTECTED)}
    assert "/healthz" in open_gets
    [api] = _deployments(docs, "api")
    [c] = api["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = _env(c, _secret_data(docs, values))
    assert ports["http"] == int(env["BALLAST_API_PORT"]) and env["BALLAST_API_HOST"] == "0.0.0.0"
    probes = [c[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c]
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in probes:
        if "httpGet" in probe:
            assert probe["httpGet"]["path"] in open_gets, probe
        port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
        assert port in ports or port in ports.values(), probe
    [service] = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["targetPort"] in ports
    assert service["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]


def test_the_engines_and_the_control_worker_probe_what_they_have(case):
    """An engine's port demands the engine token on every path but its probes, /healthz and
    /readyz (engine/server.py: a probe cannot carry a Secret); the control worker's own
    listener answers them too (ballast/probes.py). Each is probed there, on the port it is
    told to listen on, and only on paths its app serves and leaves open."""
    from starlette.routing import Route

    from ballast.probes import probes_app
    from engine.server import OPEN, create_app
    from engine.slots import EngineSlots

    _, values, docs = case
    app = probes_app(None, None, lambda: True, None)  # its routes only: nothing runs
    served = {r.path for r in app.routes if isinstance(r, Route)}
    engine_app = create_app(None, EngineSlots(1), token="t")  # its routes only, as above
    engine_served = {r.path for r in engine_app.routes if isinstance(r, Route)} & OPEN
    for name, c, _ in _containers(docs):
        if name in ("api", "migrate"):
            continue
        probes = {k: c[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c}
        env = _env(c, _secret_data(docs, values))
        if name.startswith("engine-"):
            paths = {k: p["httpGet"]["path"] for k, p in probes.items() if p["httpGet"]["port"] == "stream"}
            assert paths == dict(readinessProbe="/readyz", livenessProbe="/healthz", startupProbe="/healthz"), name
            assert set(paths.values()) <= engine_served, name
            [port] = c["ports"]
            assert (port["name"], port["containerPort"]) == ("stream", int(env["BALLAST_ENGINE_PORT"]))
        else:
            [port] = c["ports"]
            assert (port["name"], port["containerPort"]) == ("probes", int(env["BALLAST_CONTROL_PORT"]))
            assert env["BALLAST_CONTROL_HOST"] == "0.0.0.0"  # the kubelet probes the pod's address
            paths = {k: p["httpGet"]["path"] for k, p in probes.items() if p["httpGet"]["port"] == "probes"}
            assert paths == dict(readinessProbe="/readyz", livenessProbe="/healthz") and set(paths.values()) <= served


def test_each_pool_gets_its_engine_deployment(case):
    _, values, docs = case
    engines = {d["metadata"]["labels"]["ballast.dev/pool"]: d for d in _deployments(docs, "engine")}
    pools = [_merge(values["poolDefaults"], p) for p in values["pools"]]
    assert sorted(engines) == sorted(p["name"] for p in pools)
    secrets = _secret_data(docs, values)
    for pool in pools:
        d = engines[pool["name"]]
        assert d["metadata"]["name"] == f"{RELEASE}-engine-{pool['name']}"
        assert d["spec"].get("replicas") == (None if pool["autoscaling"]["enabled"] else pool["replicas"])
        pod = d["spec"]["template"]["spec"]
        [c] = pod["containers"]
        assert _env(c, secrets)["BALLAST_MODEL"] == (pool["model"] or values["model"]["name"])
        assert c["resources"]["limits"][pool["gpuResource"]] == pool["gpus"]
        assert pod.get("nodeSelector", {}) == pool["nodeSelector"]
        assert pod.get("tolerations", []) == pool["tolerations"]
        assert pod["terminationGracePeriodSeconds"] == pool["terminationGracePeriodSeconds"]
        assert c["image"].startswith(values["engineImage"]["repository"] + ":")
    selectors = [tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in engines.values()]
    assert len(set(selectors)) == len(selectors), "two pools' Deployments select each other's pods"


def test_a_pool_may_load_the_model_elsewhere_or_serve_another_with_its_own_context():
    same = _merge(INSTALL, {"pools": [{"name": "local", "model": "/mnt/models/Qwen2.5-0.5B-Instruct/"}]})
    [engine] = _deployments(render(same), "engine")
    assert engine["metadata"]["name"] == f"{RELEASE}-engine-local"
    big = {"name": "big", "model": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192, "gpus": 2}
    docs = render(_merge(INSTALL, {"pools": [{"name": "default"}, big]}))
    secrets = _secret_data(docs, INSTALL)
    envs = {name: _env(c, secrets) for name, c, _ in _containers(docs)}
    assert envs["engine-big"]["BALLAST_MAX_MODEL_LEN"] == "8192"
    assert topology.served_model(envs["engine-big"]) == "Llama-3.1-8B-Instruct"
    assert topology.problems(envs, exact_model=False) == []
    with pytest.raises(helm.HelmError, match="none serves the release's model"):
        render(_merge(INSTALL, {"pools": [big]}))
    with pytest.raises(helm.HelmError, match="one context length"):
        render(_merge(INSTALL, {"pools": [{"name": "default"}, big, dict(big, name="big2", maxModelLen=4096)]}))
    with pytest.raises(helm.HelmError, match="its maxModelLen is model.maxModelLen"):
        render(_merge(INSTALL, {"pools": [{"name": "default", "maxModelLen": 99}]}))
    with pytest.raises(helm.HelmError, match="twice"):
        render(_merge(INSTALL, {"pools": [{"name": "a"}, {"name": "a"}]}))


def test_migrations_run_as_a_hook_before_install_and_upgrade(case):
    _, values, docs = case
    [job] = [d for d in docs if d["kind"] == "Job"]
    hooks = job["metadata"]["annotations"]
    assert set(hooks["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    # The owner's Secret, where the chart makes it, is a hook before the Job (and gone after).
    owner = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-db-owner"]
    assert bool(owner) == (not values["database"]["owner"]["existingSecret"])
    for secret in owner:
        annotations = secret["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == hooks["helm.sh/hook"]
        assert int(annotations["helm.sh/hook-weight"]) < int(hooks["helm.sh/hook-weight"])
        assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_the_model_cache_shared_makes_the_tokenizer_the_engines():
    """With a ReadWriteMany claim the engines write the model cache, the api and control worker
    read its tokenizer files, read-only and offline; without, they fetch the tokenizer alone."""
    for claim in ("", "ballast-models"):
        docs = render(_merge(INSTALL, {"model": {"cache": {"existingClaim": claim}}}))
        for name, c, pod in _containers(docs):
            if name == "migrate":
                continue
            env = _env(c, _secret_data(docs, _effective(INSTALL)))
            [mount] = [m for m in c["volumeMounts"] if m["name"] == "models"]
            [volume] = [v for v in pod["volumes"] if v["name"] == "models"]
            assert env["HF_HOME"].startswith(mount["mountPath"] + "/"), name
            if claim:
                assert volume["persistentVolumeClaim"]["claimName"] == claim
                assert mount["readOnly"] == (not name.startswith("engine-")), name
                assert (env.get("HF_HUB_OFFLINE") == "1") == (not name.startswith("engine-")), name
            else:
                assert "emptyDir" in volume and not mount["readOnly"] and "HF_HUB_OFFLINE" not in env, name


def test_temporal_cloud_and_managed_postgres():
    values_file = "values-temporal-cloud-managed-pg.yaml"
    values = _effective(_user_values(values_file))
    docs = list(_rendered(values_file))
    secrets = _secret_data(docs, values)
    for name, c, _ in _containers(docs):
        env = _env(c, secrets)
        assert env["PGSSLMODE"] == "require", name
        if name == "migrate":
            continue
        assert env["TEMPORAL_TLS"] == "true" and env["TEMPORAL_API_KEY"] == "temporal-api-key", name
        profile = ClientConfigProfile.load(disable_file=True, override_env_vars={
            k: v for k, v in env.items() if k.startswith("TEMPORAL_")})
        assert profile.api_key == "temporal-api-key" and profile.address == values["temporal"]["address"]
        assert profile.tls is not None and not profile.tls.disabled
    # Every secret is the operator's: the chart makes none.
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_temporal_mtls_files_are_mounted_where_the_sdk_is_told(tmp_path):
    user = _merge(INSTALL, {"temporal": {"tls": {"enabled": True, "clientCert": "CERT", "clientKey": "KEY",
                                                 "serverCA": "CA", "serverName": "temporal.internal"}}})
    docs = render(user)
    [tls] = [d for d in docs if d["kind"] == "Secret" and d["type"] == "kubernetes.io/tls"]
    assert set(tls["stringData"]) == {"tls.crt", "tls.key", "ca.crt"}
    for name, c, pod in _containers(docs):
        if name == "migrate":
            continue
        env = _env(c, _secret_data(docs, _effective(user)))
        volumes = {v["name"]: v for v in pod["volumes"]}
        for var, key in (("TEMPORAL_TLS_CLIENT_CERT_PATH", "tls.crt"), ("TEMPORAL_TLS_CLIENT_KEY_PATH", "tls.key"),
                         ("TEMPORAL_TLS_SERVER_CA_CERT_PATH", "ca.crt")):
            path = Path(env[var])
            [mount] = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent]
            assert volumes[mount["name"]]["secret"]["secretName"] == tls["metadata"]["name"], name
            assert path.name == key, name
        # The SDK reads those very files: give it this test's copies.
        for var, key in (("TEMPORAL_TLS_CLIENT_CERT_PATH", "tls.crt"), ("TEMPORAL_TLS_CLIENT_KEY_PATH", "tls.key"),
                         ("TEMPORAL_TLS_SERVER_CA_CERT_PATH", "ca.crt")):
            (tmp_path / key).write_text(tls["stringData"][key])
            env[var] = str(tmp_path / key)
        config = ClientConfigProfile.load(disable_file=True, override_env_vars={
            k: v for k, v in env.items() if k.startswith("TEMPORAL_")}).to_client_connect_config()
        tls_config = config["tls"]
        assert not isinstance(tls_config, bool)
        assert (tls_config.client_cert, tls_config.client_private_key, tls_config.server_root_ca_cert) == \
            (b"CERT", b"KEY", b"CA")
        assert tls_config.domain == "temporal.internal"


def test_spot_pool_is_spot_and_stops_in_time():
    values_file = "values-spot-gpu.yaml"
    text = (CHART / values_file).read_text()
    values = _effective(_user_values(values_file))
    docs = list(_rendered(values_file))
    [spot] = [d for d in _deployments(docs, "engine") if d["metadata"]["labels"]["ballast.dev/pool"] == "spot"]
    pod = spot["spec"]["template"]["spec"]
    assert any("spot" in k.lower() for k in pod["nodeSelector"])
    assert any("spot" in t["key"].lower() for t in pod["tolerations"])
    assert pod["terminationGracePeriodSeconds"] < 30  # inside a spot VM's notice
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"] == spot["spec"]["selector"]
    # An on-demand pool stays beside it, and the file says why preemption is safe.
    assert len(values["pools"]) >= 2
    assert re.search(r"journal", text) and re.search(r"resumes on\s+#?\s*another engine", text)


def test_keda_scales_one_pool_per_model_on_ballasts_signal():
    """The spot pool scales on ballast_engines_wanted of its model less the on-demand pool's
    fixed replicas; its Deployment leaves the count to KEDA's HPA. Two pools of one model
    both autoscaling is refused: one signal cannot size two pools."""
    docs = list(_rendered("values-spot-gpu.yaml"))
    values = _effective(_user_values("values-spot-gpu.yaml"))
    [scaled] = [d for d in docs if d["kind"] == "ScaledObject"]
    [spot] = [d for d in _deployments(docs, "engine") if d["metadata"]["labels"]["ballast.dev/pool"] == "spot"]
    [fixed] = [d for d in _deployments(docs, "engine") if d["metadata"]["labels"]["ballast.dev/pool"] == "on-demand"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {"name": spot["metadata"]["name"]}
    assert "replicas" not in spot["spec"] and fixed["spec"]["replicas"] == 1
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 16)
    [trigger] = scaled["spec"]["triggers"]
    served = values["model"]["name"].rstrip("/").split("/")[-1]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    assert trigger["metadata"]["query"] == f'max(ballast_engines_wanted{{model="{served}"}}) - 1'
    # The series it asks for is the control worker's (telemetry/families.py).
    from telemetry import families

    wanted = families.ENGINES_WANTED
    assert (wanted._name, wanted._labelnames) == ("ballast_engines_wanted", ("model",))
    user = _user_values("values-spot-gpu.yaml")
    for pool in user["pools"]:
        pool["autoscaling"] = dict(enabled=True, prometheusAddress="http://p:9090")
    with pytest.raises(Exception, match="both autoscale"):
        render(user)
