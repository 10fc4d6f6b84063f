# Every target builds its own .venv: torch first and pinned (so no CUDA build is pulled in),
# then deepspeed and the project without build isolation (deepspeed's build imports torch).
PYTHON ?= python3
PINNED_TORCH := 2.13.0
TORCH_SPEC ?= torch==$(PINNED_TORCH)
# Where torch comes from: empty for pip's configured index (PyPI: a CUDA build on Linux), or e.g.
# https://download.pytorch.org/whl/cpu for PyTorch's CPU-only wheels.
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
# A folder to download torch's wheels into once and install them from (empty: pip's own cache decides).
# CI's lanes set it: the registry that CI's machine reaches does not let pip cache them, and torch's CUDA
# builds are 4-5 GB.
WHEELHOUSE ?=
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= tests

# CI's lanes, each "Python torch", each in a venv of its own: `make test-all` runs ruff, mypy, the whole suite
# and the README's commands on the pinned lane, and the whole suite on the oldest and the newest.
# pyproject.toml admits the lanes' Pythons and torches and what lies between, nothing wider
# (tests/unit/test_packaging.py reads the lanes with `make print-lanes` and checks that test-all runs them).
PINNED_LANE := 3.11 $(PINNED_TORCH)
OLDEST_LANE := 3.11 2.11.0
NEWEST_LANE := 3.13 2.15.0
LANE_TESTS := tests
LANE_WHEELHOUSE := $(HOME)/.cache/lightning-multids/wheels/$(if $(TORCH_INDEX),$(notdir $(TORCH_INDEX)),default)
# A lane's interpreter: .ci/cpython.sh MINOR prints python$(MINOR) from PATH, or CPython built once from
# Debian's source package and cached outside the checkout.
CPYTHON := .ci/cpython.sh

.NOTPARALLEL:
LANE_TARGETS ?= pytest
# A lane passes these to a sub-make on its command line; keep them out of the environment of what runs, where a
# `make demo` of the README's test (a new user's shell) would otherwise pick them up. (After every `?=` above:
# `unexport` defines a variable that is not yet defined, and `?=` would then leave it empty.)
unexport VENV PYTHON TORCH_SPEC WHEELHOUSE PYTEST_ARGS LANE LANE_TARGETS EXPECTED_PYTHON
.PHONY: install demo test test-quick test-all test-pinned test-oldest test-newest lane print-lanes test-readme test-gpu gpu-check gpu-wheels gpu-wheels-proof pytest fuzz realcode lint typecheck bench bench-overhead bench-host bench-hooks bench-guards bench-memory bench-frozen bench-gradcache bench-generation bench-gpu bench-launch bench-realcode bench-checkpoint lm-grid clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel "setuptools>=77"
	$(if $(WHEELHOUSE),$(PY) -m pip download --quiet --dest $(WHEELHOUSE) "$(TORCH_SPEC)" $(TORCH_INDEX_ARG))
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(WHEELHOUSE),--no-index --find-links $(WHEELHOUSE),$(TORCH_INDEX_ARG))
	$(PY) -m pip install --quiet --no-build-isolation "deepspeed>=0.19.8,<0.20"
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev,examples,realcode]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lightning-multids fit --config configs/gan.yaml

# The README's test command: CI's three lanes, and beside them (.ci/beside.sh) the README's own commands run as
# printed on a fresh clone of HEAD (tests/readme), from the pinned lane's venv, which is made first.
test-all:
	$(MAKE) lane LANE="$(PINNED_LANE)" LANE_TARGETS=install
	bash .ci/beside.sh "the doc test" '$(MAKE) lane LANE="$(PINNED_LANE)" LANE_TARGETS=test-readme' \
		$(MAKE) test-pinned test-oldest test-newest

test: lint typecheck pytest

# tests/unit/test_packaging.py checks that the venv runs EXPECTED_PYTHON (a lane's) and the torch installed first.
pytest: $(STAMP)
	EXPECTED_TORCH="$(TORCH_SPEC)" EXPECTED_PYTHON="$(EXPECTED_PYTHON)" $(PY) -m pytest $(PYTEST_ARGS)

# The fast local loop: the unit tests and the first test of each 2-rank test file (TESTING.md).
test-quick: $(STAMP)
	$(PY) -m pytest tests/unit tests/distributed tests/fuzz/test_fuzz.py --one-per-file -m 'not examples'

# The differential fuzzer over a range of seeds (tests/fuzz): each seed's case trained on 2 CPU ranks and in plain
# PyTorch, classified, failures shrunk; the report in outputs/fuzz/. `make test` runs a fixed slice of it.
FUZZ_SEEDS ?= 0:200
FUZZ_ARGS ?=
fuzz: $(STAMP)
	$(PY) -m tests.fuzz.fuzz --seeds $(FUZZ_SEEDS) --report outputs/fuzz/report-$(subst :,-,$(FUZZ_SEEDS)).json $(FUZZ_ARGS)

# The real-code suite (tests/realcode: public packages' training code against DDPStrategy) at every setup: ZeRO 0, 2,
# 3 and the mixed one. `make test` runs each case's CI setups (ZeRO-3, and mixed where a case has one).
realcode: $(STAMP)
	REALCODE_STAGES=all $(PY) -m pytest tests/realcode -rxX

test-readme: $(STAMP)
	README_DOCTEST=1 $(PY) -m pytest tests/readme -rs

test-pinned:
	$(MAKE) lane LANE="$(PINNED_LANE)" LANE_TARGETS="lint typecheck pytest"

test-oldest:
	$(MAKE) lane LANE="$(OLDEST_LANE)"

test-newest:
	$(MAKE) lane LANE="$(NEWEST_LANE)"

# `make lane LANE="3.13 2.15.0"`: LANE_TARGETS (default: the suite) in .venv-py3.13-torch2.15.0.
lane:
	$(if $(word 2,$(LANE)),,$(error make lane needs LANE="PYTHON TORCH", e.g. LANE="3.13 2.15.0"))
	python=$$($(CPYTHON) $(word 1,$(LANE))) && $(MAKE) $(LANE_TARGETS) PYTHON="$$python" \
		VENV=.venv-py$(word 1,$(LANE))-torch$(word 2,$(LANE)) TORCH_SPEC=torch==$(word 2,$(LANE)) \
		WHEELHOUSE=$(LANE_WHEELHOUSE) PYTEST_ARGS="$(LANE_TESTS)" EXPECTED_PYTHON=$(word 1,$(LANE))

print-lanes:
	@printf '%s\n' "$(PINNED_LANE)" "$(OLDEST_LANE)" "$(NEWEST_LANE)"

# The GPU suite (pytest marker `gpu`): one process on one GPU, nccl. Where there is no CUDA it prints
# "no CUDA" and skips. On a machine whose packages are on PYTHONPATH: `make test-gpu GPU_PYTHON=python3`.
GPU_PYTHON ?= $(PY)
test-gpu: $(if $(filter $(PY),$(GPU_PYTHON)),$(STAMP))
	$(GPU_PYTHON) -m pytest -m gpu tests/gpu -rs

# The check of a machine with one GPU (benchmarks/gpu_check.sh: the GPU suite, syncs per step, peak memory, step
# time; about 8 minutes; the report in $$OUT or outputs/gpu-check). It runs on that machine's python3 and takes
# what that lacks from .gpu/whl: `make gpu-wheels` first, on a machine that reaches PyPI (see TESTING.md).
gpu-check:
	bash benchmarks/gpu_check.sh

# What the GPU machine lacks, as wheels for its Python (GPU_PY_VERSION) on x86-64 Linux, in GPU_WHEEL_DIR: DeepSpeed
# (built here) and what `import deepspeed` and its JIT builds import, jsonargparse for the CLI, pytest-xdist and
# pytest-timeout. Each at the venv's version where the venv has it. The machine has Python 3.12, torch, Lightning,
# torchmetrics, tensorboard, scikit-learn and pytest, and no network (the device tool's page).
GPU_PY_VERSION ?= 3.12
GPU_WHEEL_DIR ?= .gpu/whl
GPU_WHEELS := einops msgpack psutil ninja py-cpuinfo hjson pydantic pydantic-core annotated-types typing-inspection \
	typing-extensions jsonargparse docstring-parser typeshed-client pytest-xdist execnet pytest-timeout
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEEL_DIR) && mkdir -p $(GPU_WHEEL_DIR)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEEL_DIR) $$($(PY) benchmarks/gpu_wheels.py pins $(GPU_WHEELS))
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEEL_DIR) \
		$$($(PY) -m pip list --format=freeze 2>/dev/null | grep -i '^deepspeed==')
	ls $(GPU_WHEEL_DIR)

# Proves the carried wheels complete before a GPU is spent on them: the same list for this machine's Python 3.11,
# installed as benchmarks/gpu_check.sh installs it (--no-index) into a new venv holding only what the GPU machine
# has, which then imports DeepSpeed, the package and the CLI and collects the GPU suite under pytest-xdist; and
# every wheel of $(GPU_WHEEL_DIR) is checked to install on CPython $(GPU_PY_VERSION) (its tags) with what it requires
# there carried or on the GPU machine (benchmarks/gpu_wheels.py check).
GPU_PROOF := .venv-gpu-proof
gpu-wheels-proof: gpu-wheels
	$(MAKE) gpu-wheels GPU_PY_VERSION=3.11 GPU_WHEEL_DIR=.gpu/whl-proof
	rm -rf $(GPU_PROOF) /tmp/gpu-proof-site && $(PYTHON) -m venv $(GPU_PROOF)
	$(GPU_PROOF)/bin/pip install -q "torch==$(PINNED_TORCH)" "lightning==2.6.6" torchmetrics tensorboard \
		scikit-learn pytest
	$(GPU_PROOF)/bin/pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-proof-site .gpu/whl-proof/*.whl
	PYTHONPATH=/tmp/gpu-proof-site:$(CURDIR) $(GPU_PROOF)/bin/python -c \
		"import deepspeed, lightning_multids, lightning_multids.cli, xdist, cpuinfo, ninja; print('imports: ok')"
	PYTHONPATH=/tmp/gpu-proof-site:$(CURDIR) $(GPU_PROOF)/bin/python -m pytest -q -p xdist -p timeout --collect-only \
		-m gpu tests/gpu | tail -1
	$(GPU_PROOF)/bin/python benchmarks/gpu_wheels.py check $(GPU_WHEEL_DIR) --python-version $(GPU_PY_VERSION)

bench: bench-overhead bench-host bench-hooks bench-guards bench-memory bench-frozen bench-gradcache bench-generation \
	bench-checkpoint

# Checkpoint saves: DDP's file, the directory and the single file at ZeRO 0/2/3 (128 MiB of weights, Adam).
bench-checkpoint: $(STAMP)
	cd benchmarks && ../$(VENV)/bin/torchrun --nproc-per-node 2 checkpoint_save.py --stages 0 2 3

bench-overhead: $(STAMP)
	for stage in 0 1 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --case gan --stage $$stage; done
	for stage in 0 1 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --case distill --stage $$stage --rounds 12 --steps 100; done
	for stage in 0 1 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --case single --stage $$stage --rounds 12 --steps 100; done
	for case in gan distill; do for stage in 0 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --case $$case --stage $$stage --arch transformer \
			--steps 20; done; done

# The language-model distillation of docs/language-models.md over 3 seeds and both held-out splits: whether the
# teacher helps (not part of `bench`: about half an hour on 2 CPU cores). Writes outputs/lm-grid/results.json.
lm-grid: $(STAMP)
	$(PY) benchmarks/lm_grid.py

# The strategy's host time per step at near-zero compute, split per function (one process, no GPU needed).
bench-host: $(STAMP)
	for case in gan distill single; do for stage in 0 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node 1 benchmarks/host.py --case $$case --stage $$stage; done; done

# The cost of one gradient hook per parameter: the strategy's, a bare one, torch's multi-grad hook (one process).
bench-hooks: $(STAMP)
	$(PY) benchmarks/hooks.py --params 300
	$(VENV)/bin/torchrun --nproc-per-node 1 benchmarks/zero3_hooks.py --layers 24

bench-guards: $(STAMP)
	cd benchmarks && ../$(VENV)/bin/torchrun --nproc-per-node 1 grad_reads.py --out ../outputs/bench/grad_reads.json

# Not part of `bench`: needs CUDA GPUs (all of this machine's, over nccl) and a CUDA build of torch.
GPUS ?= $(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
bench-gpu: $(STAMP)
	for precision in bf16-mixed 16-mixed; do for arch in mlp transformer; do for case in gan distill single; do \
		for stage in 0 1 2 3; do $(VENV)/bin/torchrun --nproc-per-node $(GPUS) benchmarks/overhead.py --device cuda \
			--precision $$precision --arch $$arch --case $$case --stage $$stage; done; done; done; done
	for stage in 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node $(GPUS) benchmarks/frozen.py --device cuda --stage $$stage; done
	$(VENV)/bin/torchrun --nproc-per-node $(GPUS) benchmarks/generation.py --rounds 6 --tokens 64

bench-memory: $(STAMP)
	for n in 1 2 4; do for stage in 1 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node $$n benchmarks/memory.py states --stage $$stage; done; done
	for n in 2 4; do \
		$(VENV)/bin/torchrun --nproc-per-node $$n benchmarks/memory.py states --stage 2 --hidden 256 --layers 24; done
	for malloc in "" "MALLOC_MMAP_THRESHOLD_=65536"; do for teacher in "0" "3" "3 --deepspeed-defaults"; do \
		env $$malloc $(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/memory.py peak --teacher-stage $$teacher \
			--teacher-hidden 2048 --teacher-layers 36; done; done

# A frozen teacher beside a student: two engines against one, ZeRO-2 and -3, 1 and 2 processes (bench-gpu: on GPUs).
bench-frozen: $(STAMP)
	for n in 1 2; do for stage in 2 3; do \
		$(VENV)/bin/torchrun --nproc-per-node $$n benchmarks/frozen.py --stage $$stage; done; done

# Generation by a ZeRO-3 actor: per-layer gathering, strategy.gathered(name), and the model whole (bench-gpu: on GPUs).
bench-generation: $(STAMP)
	for n in 1 2; do $(VENV)/bin/torchrun --nproc-per-node $$n benchmarks/generation.py --rounds 6 --tokens 32; done

# The fixed cost of a 2-rank test launch: new interpreters against ranks forked from the harness's fork server.
bench-launch: $(STAMP)
	PYTHONPATH=. $(PY) benchmarks/launch.py --rounds 10

# The real-code suite's cases (tests/realcode) under DDPStrategy, the strategy at ZeRO-2 and -3 and, for three of
# them, a hand-written DeepSpeed loop: engine build, time to the first step and step time (one launch per case).
# Not part of `bench`: about 9 minutes on 2 CPU cores.
REALCODE_BENCH_CASES := transformers_distillation x_transformers_belief_state vector_quantize_pytorch \
	pytorch_metric_learning
bench-realcode: $(STAMP)
	for case in $(REALCODE_BENCH_CASES); do \
		$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/realcode.py --case $$case --rounds 11 --steps 20 || exit 1; done

bench-gradcache: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/gradcache.py --stage 2
	$(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/gradcache.py --stage 3 --out outputs/bench/gradcache_zero3.json

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_multids lightning_multids_cli.py tests examples benchmarks
	$(VENV)/bin/ruff format --check lightning_multids lightning_multids_cli.py tests examples benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .venv-py*-torch* lightning_logs outputs .pytest_cache
