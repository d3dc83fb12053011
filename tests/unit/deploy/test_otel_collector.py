"""deploy/otel/: the OpenTelemetry Collector configurations and the cluster Tempo datasource.

No Collector binary can be installed here, so the configs are read by a checker that knows the
components they use: each component's settings as its Go config struct names them
(`mapstructure` tags in opentelemetry-collector(-contrib): receiver/otlpreceiver,
processor/memorylimiterprocessor, processor/batchprocessor, processor/tailsamplingprocessor,
exporter/otlpexporter, exporter/loadbalancingexporter). Unknown sections, components or keys,
a pipeline naming an undefined component, a policy whose settings do not match its type, and a
Go duration that does not parse all fail, as the Collector's own config loading fails on them.
The sampler's policy is also tied to what the sidecar really marks (telemetry/export/otlp.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from telemetry.export.otlp import INCIDENT, KEPT_FOR, SAMPLED, SLOW

OTEL = Path(__file__).resolve().parents[3] / "deploy" / "otel"

DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
TLS = {"insecure": bool, "insecure_skip_verify": bool, "ca_file": str, "cert_file": str,
       "key_file": str, "server_name_override": str}  # fmt: skip
GRPC_CLIENT = {"endpoint": str, "tls": TLS, "compression": str, "headers": dict,
               "timeout": "duration", "sending_queue": dict, "retry_on_failure": dict,
               "balancer_name": str, "keepalive": dict, "wait_for_ready": bool}  # fmt: skip
POLICY_TYPES = {
    "always_sample": None,
    "latency": {"threshold_ms": int, "upper_threshold_ms": int},
    "numeric_attribute": {"key": str, "min_value": int, "max_value": int, "invert_match": bool},
    "probabilistic": {"hash_salt": str, "sampling_percentage": (int, float)},
    "status_code": {"status_codes": [str]},
    "string_attribute": {"key": str, "values": [str], "enabled_regex_matching": bool,
                         "cache_max_size": int, "invert_match": bool},
    "rate_limiting": {"spans_per_second": int},
    "span_count": {"min_spans": int, "max_spans": int},
    "trace_state": {"key": str, "values": [str]},
    "boolean_attribute": {"key": str, "value": bool, "invert_match": bool},
    "ottl_condition": {"error_mode": str, "span": [str], "spanevent": [str]},
    "composite": dict,
    "and": dict,
}  # fmt: skip
POLICY = {"name": str, "type": str, **{name: cfg for name, cfg in POLICY_TYPES.items() if cfg}}
# section -> component type -> its settings
COMPONENTS: dict[str, dict[str, Any]] = {
    "receivers": {
        "otlp": {"protocols": {"grpc": {"endpoint": str, "tls": dict, "max_recv_msg_size_mib": int,
                                        "keepalive": dict},
                               "http": {"endpoint": str, "tls": dict, "cors": dict}}},
    },
    "processors": {
        "memory_limiter": {"check_interval": "duration", "limit_mib": int, "spike_limit_mib": int,
                           "limit_percentage": int, "spike_limit_percentage": int},
        "batch": {"send_batch_size": int, "send_batch_max_size": int, "timeout": "duration",
                  "metadata_keys": [str], "metadata_cardinality_limit": int},
        "tail_sampling": {"decision_wait": "duration", "num_traces": int,
                          "expected_new_traces_per_sec": int, "policies": [POLICY]},
    },
    "exporters": {
        "otlp": GRPC_CLIENT,
        "loadbalancing": {
            "routing_key": str,
            "protocol": {"otlp": GRPC_CLIENT},
            "resolver": {"static": {"hostnames": [str]},
                         "dns": {"hostname": str, "port": str, "interval": "duration",
                                 "timeout": "duration"},
                         "k8s": {"service": str, "ports": [int], "timeout": "duration"}},
        },
    },
}  # fmt: skip
SECTIONS = {"receivers", "processors", "exporters", "extensions", "connectors", "service"}


def check(value: Any, spec: Any, where: str) -> list[str]:
    """Problems of `value` against `spec` (a type, "duration", a dict of keys, a [item] list)."""
    if spec == "duration":
        ok = isinstance(value, str) and DURATION.match(value)
        return [] if ok else [f"{where}: {value!r} is not a Go duration"]
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{where}: a list is expected"]
        return [p for i, item in enumerate(value) for p in check(item, spec[0], f"{where}[{i}]")]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{where}: a mapping is expected"]
        problems = [f"{where}.{key}: unknown setting" for key in value if key not in spec]
        return problems + [
            p
            for key, item in value.items()
            if key in spec
            for p in check(item, spec[key], f"{where}.{key}")
        ]
    if spec is dict:
        return [] if isinstance(value, dict) else [f"{where}: a mapping is expected"]
    if (
        isinstance(value, bool)
        and spec is not bool
        and bool not in (spec if isinstance(spec, tuple) else (spec,))
    ):
        return [f"{where}: {value!r} is a bool"]
    return [] if isinstance(value, spec) else [f"{where}: {value!r} is not {spec}"]


def policy_problems(policy: dict, where: str) -> list[str]:
    kind = policy.get("type")
    if kind not in POLICY_TYPES:
        return [f"{where}.type: unknown policy type {kind!r}"]
    others = [k for k in policy if k in POLICY_TYPES and k != kind]
    problems = [f"{where}.{k}: settings of another policy type than {kind}" for k in others]
    if POLICY_TYPES[kind] and kind not in policy:
        problems.append(f"{where}: a {kind} policy without its {kind} settings")
    return problems + ([] if policy.get("name") else [f"{where}: no name"])


def config_problems(config: dict) -> list[str]:
    problems = [f"{key}: unknown section" for key in config if key not in SECTIONS]
    defined: dict[str, set[str]] = {}
    for section in ("receivers", "processors", "exporters"):
        defined[section] = set()
        for component, settings in (config.get(section) or {}).items():
            kind = component.split("/", 1)[0]
            if kind not in COMPONENTS[section]:
                problems.append(f"{section}.{component}: unknown component type {kind!r}")
                continue
            defined[section].add(component)
            problems += check(settings or {}, COMPONENTS[section][kind], f"{section}.{component}")
            for i, policy in enumerate((settings or {}).get("policies", [])):
                problems += policy_problems(policy, f"{section}.{component}.policies[{i}]")
    pipelines = (config.get("service") or {}).get("pipelines") or {}
    if not pipelines:
        problems.append("service.pipelines: none")
    used: set[tuple[str, str]] = set()
    for name, pipeline in pipelines.items():
        if name.split("/", 1)[0] not in ("traces", "metrics", "logs"):
            problems.append(f"service.pipelines.{name}: unknown signal")
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                used.add((section, component))
                if component not in defined[section]:
                    problems.append(
                        f"service.pipelines.{name}.{section}: {component} is not defined"
                    )
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            problems.append(f"service.pipelines.{name}: needs receivers and exporters")
    problems += [
        f"{section}.{component}: defined but in no pipeline"
        for section, names in defined.items()
        for component in names
        if (section, component) not in used
    ]
    return problems


@pytest.mark.parametrize("name", ["collector-sampler.yaml", "collector-gateway.yaml"])
def test_each_collector_config_loads_with_the_components_it_names(name: str) -> None:
    config = yaml.safe_load((OTEL / name).read_text())
    assert config_problems(config) == []


def test_the_checker_refuses_what_the_collector_refuses() -> None:
    """The checker can fail: each broken copy of the sampler config names its fault."""
    good = yaml.safe_load((OTEL / "collector-sampler.yaml").read_text())

    def broken(edit) -> list[str]:
        config = yaml.safe_load(yaml.safe_dump(good))
        edit(config)
        return config_problems(config)

    assert broken(lambda c: c["processors"]["batch"].update(timout="1s")) == [
        "processors.batch.timout: unknown setting"
    ]
    assert broken(lambda c: c["processors"]["tail_sampling"].update(decision_wait="10 sec")) == [
        "processors.tail_sampling.decision_wait: '10 sec' is not a Go duration"
    ]
    assert broken(
        lambda c: c["service"]["pipelines"]["traces"]["exporters"].append("otlp/tempo")
    ) == ["service.pipelines.traces.exporters: otlp/tempo is not defined"]
    policies = lambda c: c["processors"]["tail_sampling"]["policies"]  # noqa: E731
    assert broken(lambda c: policies(c)[0].update(type="numeric_attribute")) == [
        "processors.tail_sampling.policies[0].string_attribute: settings of another policy type "
        "than numeric_attribute",
        "processors.tail_sampling.policies[0]: a numeric_attribute policy without its "
        "numeric_attribute settings",
    ]
    assert broken(lambda c: c.update(exporter={})) == ["exporter: unknown section"]


def test_the_sampler_keeps_what_the_sidecar_marks() -> None:
    """The attribute and values the policy keeps are the ones the exporter writes; the share of
    the rest is a probabilistic policy, and traces with an error status are kept."""
    config = yaml.safe_load((OTEL / "collector-sampler.yaml").read_text())
    policies = {p["type"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    marked = policies["string_attribute"]["string_attribute"]
    assert marked["key"] == KEPT_FOR
    assert set(marked["values"]) == {INCIDENT, SLOW} and SAMPLED not in marked["values"]
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert 0 < policies["probabilistic"]["probabilistic"]["sampling_percentage"] < 100
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["processors"].index("tail_sampling") < pipeline["processors"].index("batch")


def test_the_gateway_routes_whole_traces_to_the_samplers() -> None:
    config = yaml.safe_load((OTEL / "collector-gateway.yaml").read_text())
    balancer = config["exporters"]["loadbalancing"]
    assert balancer.get("routing_key", "traceID") == "traceID"  # the default: by trace id
    assert "otel-sampler-headless" in balancer["resolver"]["dns"]["hostname"]
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["loadbalancing"]


def test_the_cluster_tempo_datasource_is_valid_provisioning() -> None:
    """Grafana's provisioning format (apiVersion 1, a datasources list with name, type, uid,
    access, url, jsonData), a Tempo datasource with another uid than the per-node one, its URL
    from Grafana's environment."""
    text = (OTEL / "grafana-datasource-tempo.yaml").read_text()
    doc = yaml.safe_load(text)
    assert set(doc) == {"apiVersion", "datasources"} and doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    known = {"name", "uid", "type", "access", "url", "isDefault", "editable", "jsonData",
             "secureJsonData", "orgId", "basicAuth", "version"}  # fmt: skip
    assert set(ds) <= known and {"name", "type", "uid", "url"} <= set(ds)
    assert ds["type"] == "tempo" and ds["access"] == "proxy"
    assert ds["uid"] != "ascend-guard-tempo" and re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", ds["uid"])
    assert re.fullmatch(r"\$\{[A-Z_]+\}", ds["url"])
    tags = ds["jsonData"]["tracesToMetrics"]["tags"]
    assert {"key": "service.name", "value": "engine"} in tags  # the exporter's service.name
    # Grafana expands $X in provisioning files: a literal $ (PromQL's $__tags) is written $$
    for query in ds["jsonData"]["tracesToMetrics"]["queries"]:
        assert "$__tags" not in query["query"].replace("$$__tags", "")
