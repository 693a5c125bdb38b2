# torchalpa: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
NPROC  ?= 4
NETNS  := ../shared/tools/netns_bytes.sh

.PHONY: demo demo-pipeline test test-all test-browser test-gpu bench bench-gpu env clean lint

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,lint]'
	@# torchvision for the model suite, kept off the path (torchalpa.suite.cases explains)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
		-c constraints.txt --target $(VENV)/torchvision torchvision
	@rm -f $(VENV)/.installed-* && touch $@

env: $(STAMP)

# The quickstart MLP on 4 gloo ranks (CPU), next to DDP; then a pipelined GPT.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) \
		examples/quickstart.py --compare ddp
	@echo; echo "=== pipeline parallelism: examples/pipeline.py (make demo-pipeline) ==="
	$(MAKE) --no-print-directory demo-pipeline

# A GPT in pipeline stages on 4 gloo ranks (CPU), checked against single-device training.
# Two stages forced: the stage search alone keeps this small GPT on CPU ranks in one stage
# (the example prints why).
demo-pipeline: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) \
		examples/pipeline.py --stages 2

# Lint: ruff (pyflakes + pycodestyle) over the tree, then basedpyright (basic mode) over the
# package; both are configured in pyproject.toml. pyright cannot follow setup.cfg's
# package_dir, so build/typecheck/torchalpa mirrors the installed layout with symlinks.
lint: $(STAMP)
	$(BIN)/ruff check .
	@rm -rf build/typecheck && mkdir -p build/typecheck/torchalpa
	@for p in torchalpa/*; do ln -s ../../../$$p build/typecheck/torchalpa/; done
	@for d in frontends passes runtime; do ln -s ../../../$$d build/typecheck/torchalpa/$$d; done
	$(BIN)/basedpyright

# The test suite (must stay well under 15 minutes on 2 cores; where its time goes, per
# file, and what was cut: benchmarks/RESULTS.md, "make test trimmed").
# Two pytest workers (pytest-xdist), a test file each at a time: most tests are one
# single-threaded process (OMP_NUM_THREADS=1), so one worker alone leaves a core idle.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
		-m "not slow and not gpu and not browser" tests

# Everything: the slow multi-process runs (2 and 8 ranks) and the checked benchmarks
# (the issue-sized quickstart against DDP/FSDP2, bytes counted on loopback in a private
# network namespace; one-rank overhead against eager PyTorch).
test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m slow tests
	$(MAKE) test-browser
	$(MAKE) bench

# plan.to_html as headless Chromium renders it (tests marked browser): installs Debian's
# chromium first when it is missing (needs root, as on CI and the development machines).
test-browser: $(STAMP)
	@command -v chromium >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	TORCHALPA_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m browser tests

bench: $(STAMP)
	$(BIN)/python benchmarks/quickstart_vs_ddp.py --check
	$(BIN)/python benchmarks/one_rank_overhead.py --check

# On a CUDA machine: the tests marked gpu and the one-GPU benchmark. Such a machine has
# PyTorch but may lack a package registry: prepare the checkout with
# ../shared/tools/gpu_wheels.sh, install as it says, then `make test-gpu GPU_PYTHON="python3 -P"`.
GPU_PYTHON ?= $(BIN)/python
test-gpu:
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests

bench-gpu:
	$(GPU_PYTHON) benchmarks/one_gpu.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
