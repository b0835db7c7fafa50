# make setup: Debian packages the tests need, then .venv with torch==2.13.0 (first),
#             the core and every plugin (editable, with its `test` extra)
# make demo:  the nanoGPT pre-training job on the Python reference manual
# make test:  every test suite, core and each plugin, two at a time, without the tests
#             marked `slow` (scripts/run_tests.py: one queue of suites, the core's first,
#             then the plugins in PLUGIN_ORDER; each lane takes the next when it is free)
# make test SLOW=1: every test (what .ci/run runs): the same queue with the core's slow
#             tests of SLOW_FIRST as one suite at its head and the others as SLOW_CHUNKS
#             more suites after the core's other tests
# make gpu-check: first the node check's probes on this machine's GPUs (every GPU's
#             bf16 batched matmul, an all-gather per GPU pair; on a machine without CUDA
#             the CPU path; one JSON line: python -m dlrover_core.runtime.node_probe), then
#             on a CUDA machine nanoGPT on cuda for 200 steps, the flash D2H figure and
#             the gpu-marked tests, each with time reserved within 10 minutes, one JSON
#             report (scripts/gpu_check.py); without CUDA it prints "no CUDA device", exits 0
# make cluster-up NODES=2 [CPUS=2] [GCS_FT=1]: a head and NODES worker nodes, each its own
#             `ray start` process on this machine (dlrover cluster up; GCS_FT=1: with a
#             redis-server for Ray's GCS fault tolerance); prints the export lines for clients
# make cluster-down: stop exactly those nodes (dlrover cluster down)
# make crash-test [CRASH_ARGS=--quick]: the crash-point harness (scripts/crash_test.py):
#             every crash point of the flash, disk and ODL savers x each fault x 1, 2, 4
#             ranks, then a restart and the invariants; ends with one JSON line, exit 1 on
#             a violation (make test SLOW=1 faults the flash persister's points at 2 ranks
#             only, SIGKILLed at the 4-rank runs' hits too: --persister-ranks 2)
# make chaos [MINUTES=30] [SEED=0] [FAULTS=kill_rank,...] [ELASTIC=1] [JOB_SEED=n]
#            [SAVE_REFERENCE=file | REFERENCE=file]: benchmarks/chaos.py: a 3-node
#             cluster, the nanoGPT flash job once fault-free and once under a seeded random
#             schedule of real faults, then the invariants; one JSON line, exit 1 on a
#             violation. ELASTIC=1: the role resizes with the nodes (faults during a
#             resize); a saved fault-free run serves later seeds of the same JOB_SEED
# make dist:  a wheel and an sdist of the core and every plugin under dist/ (twine check)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
STAMP := $(VENV)/.installed
SETUP_LOG := $(VENV)/setup.log
PYTEST_ARGS ?=
# SLOW=1: make test also runs the tests marked `slow` (long scenarios); .ci/run sets it
SLOW ?=
# the plugins' suites, the longest first: their place in make test's queue (after any
# plugin not named here; scripts/run_tests.py). A run here without SLOW=1 (2026-12-01):
# flashckpt 272 s, odl 166, ppo 98, megatron 95, multimodal 71, fsdp 57, deepspeed 28,
# sft 3; with SLOW=1 flashckpt 941, ppo 499, odl 417, fsdp 350, megatron 303
PLUGIN_ORDER ?= flashckpt odl ppo megatron fsdp multimodal deepspeed sft
# with SLOW=1, the core's slow tests run as this many suites (whole files in each), so
# that both lanes share them
SLOW_CHUNKS ?= 8
# with SLOW=1, the core's test files whose slow tests run first, as one suite: the
# crash-point enumeration (~25 min) and the chaos runs (1-9 min each) each keep a core
# busy; run at the same time (a run here, 2026-12-01) two elastic chaos runs ran past
# pytest's 600 s limit
SLOW_FIRST ?= tests/test_crash_points.py tests/test_chaos.py
NODES ?= 2
CPUS ?= 2
GCS_FT ?=
# Debian packages the test suites need (the odl plugin's Redis Streams cases run a real redis-server)
APT_PACKAGES := redis-server
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test gpu-check dist clean cluster-up cluster-down

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) Makefile
	@for pkg in $(APT_PACKAGES); do \
	  dpkg -s $$pkg >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $(APT_PACKAGES); break; }; \
	done
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# pip's own output (setuptools' notes on editable installs, nine blocks) goes to a log,
	@# printed only when an install fails
	@echo "setup: pip, torch==2.13.0 (first), the core and every plugin (log: $(SETUP_LOG))"
	@: >$(SETUP_LOG)
	@$(BIN)/python -m pip install -q --upgrade pip >>$(SETUP_LOG) 2>&1 || { cat $(SETUP_LOG); exit 1; }
	@$(BIN)/python -m pip install -q torch==2.13.0 >>$(SETUP_LOG) 2>&1 || { cat $(SETUP_LOG); exit 1; }
	@$(BIN)/python -m pip install -q -e ".[test]" $(foreach p,$(PLUGINS),-e "$(p:%/=%)[test]") \
	  >>$(SETUP_LOG) 2>&1 || { cat $(SETUP_LOG); exit 1; }
	touch $(STAMP)

demo: setup
	$(BIN)/dlrover submit examples/nanogpt/job.yaml

test: setup
	SLOW=$(SLOW) $(BIN)/python scripts/run_tests.py --plugins "$(PLUGINS)" --order "$(PLUGIN_ORDER)" \
	  --slow-chunks $(SLOW_CHUNKS) --slow-first "$(SLOW_FIRST)" -- $(PYTEST_ARGS)

cluster-up: setup
	$(BIN)/dlrover cluster up --nodes $(NODES) --cpus-per-node $(CPUS) $(if $(GCS_FT),--gcs-ft)

cluster-down:
	$(BIN)/dlrover cluster down

gpu-check: setup
	timeout 300 $(BIN)/python -m dlrover_core.runtime.node_probe
	$(BIN)/python scripts/gpu_check.py

.PHONY: crash-test
crash-test: setup
	$(BIN)/python scripts/crash_test.py $(CRASH_ARGS)

MINUTES ?= 30
SEED ?= 0
FAULTS ?=
ELASTIC ?=
JOB_SEED ?=
REFERENCE ?=
SAVE_REFERENCE ?=
.PHONY: chaos
chaos: setup
	$(BIN)/python benchmarks/chaos.py --minutes $(MINUTES) --seed $(SEED) $(if $(FAULTS),--faults $(FAULTS)) \
		$(if $(ELASTIC),--elastic) $(if $(JOB_SEED),--job-seed $(JOB_SEED)) \
		$(if $(REFERENCE),--reference $(REFERENCE)) $(if $(SAVE_REFERENCE),--save-reference $(SAVE_REFERENCE))

dist: setup
	scripts/build_dists.sh $(BIN)/python

clean:
	rm -rf $(VENV) runs dist
