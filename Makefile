# Two commands do everything on a fresh clone: `make demo` and `make test`.
VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP_ARGS  ?=
# On a machine whose pip does not already find the CPU build of torch, use e.g.
#   make demo PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
export DS_ACCELERATOR ?= cpu
# CUDA=1: the CUDA build of torch (PyPI's torch on Linux x86_64) with constraints-cuda.txt; CUDA=0: the CPU build
# with constraints.txt. Default: 1 where an NVIDIA driver is found (nvidia-smi on PATH or /proc/driver/nvidia/version).
CUDA      ?= $(if $(or $(shell command -v nvidia-smi 2>/dev/null),$(wildcard /proc/driver/nvidia/version)),1,0)
ifeq ($(CUDA),1)
LOCK      := constraints-cuda.txt
STAMP     := $(VENV)/.installed-cuda
BUILD     := CUDA
else
LOCK      := constraints.txt
STAMP     := $(VENV)/.installed
BUILD     := CPU
endif

.PHONY: install demo test lint bench clean-demo lock lock-cuda audit

$(STAMP): pyproject.toml $(LOCK) deploy/system-packages.sh
	@bash deploy/system-packages.sh
	@echo "make install: $(VENV) with the pinned environment ($(LOCK), torch $(BUILD) build; pip's output: $(VENV)/install.log)"
	@python3 -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade "pip==26.3" > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
ifeq ($(CUDA),1)
# a CPU build of torch left by an earlier CPU install satisfies torch==2.13.0: replace it
	@$(PY) -c "import importlib.util as u, sys; sys.exit(bool(u.find_spec('torch')) and __import__('torch').version.cuda is None)" \
	    || $(PY) -m pip uninstall --quiet --yes torch
endif
	@$(PY) -m pip install --quiet $(PIP_ARGS) -c $(LOCK) -e ".[dev]" >> $(VENV)/install.log 2>&1 \
	    || { cat $(VENV)/install.log; exit 1; }
	@$(PY) -c "import sys, torch, prefect.server.api.server, deepspeed, mlflow; cuda = torch.version.cuda; \
	    build = f'CUDA {cuda} build' if cuda else 'CPU build'; v = torch.__version__.split('+')[0]; \
	    want = 'CUDA build' if '$(BUILD)' == 'CUDA' else 'CPU build'; hint = ' (PIP_ARGS or a pip index with other builds?)'; \
	    sys.exit(f'a {build} of torch {torch.__version__} was installed, not the {want}{hint}') \
	    if (cuda is None) == (want == 'CUDA build') else print(f'make install: torch {v} ({build}) installed')"
	@rm -f $(VENV)/.installed $(VENV)/.installed-cuda
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@$(VENV)/bin/lifecycle run deploy/configs/demo.yaml

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# ruff and mypy at the level the code passes (pyproject.toml's [tool.ruff] and [tool.mypy]); `make test` runs it first
lint: $(STAMP)
	@$(VENV)/bin/ruff check --quiet .
	@$(VENV)/bin/mypy --no-error-summary lifecycle flows tasks lineage && echo "make lint: ruff and mypy clean"

bench: $(STAMP)
	$(PY) -m bench

clean-demo:
	-$(VENV)/bin/lifecycle down deploy/configs/demo.yaml
	rm -rf runs/demo

# Re-pin the whole environment after changing dependencies in pyproject.toml.
lock:
	$(PY) -m pip freeze --exclude-editable | sed -e 's/^torch==2.13.0+cpu$$/torch==2.13.0/' > constraints.txt

# The CUDA lock: constraints.txt's versions plus the CUDA libraries PyPI's torch (its CUDA build on Linux x86_64)
# requires, resolved from PyPI's metadata only (nothing large is downloaded); run on Linux x86_64 after `make lock`.
lock-cuda:
	env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null $(PY) -m pip install \
	    --quiet --dry-run --ignore-installed --index-url https://pypi.org/simple --report $(VENV)/lock-cuda.json \
	    -c constraints.txt -e ".[dev]"
	$(PY) -c "import json; r = json.load(open('$(VENV)/lock-cuda.json')); \
	    pins = [(i['metadata']['name'], i['metadata']['version']) for i in r['install'] if 'dir_info' not in i['download_info']]; \
	    print('# make lock-cuda: constraints.txt with the CUDA build of torch (PyPI, Linux x86_64) and what it requires'); \
	    print('\n'.join(f'{n}=={v}' for n, v in sorted(pins, key=lambda p: p[0].lower())))" > constraints-cuda.txt

# Known vulnerabilities in the pinned versions (needs the PyPI JSON API or api.osv.dev; see docs/operations.md, "Paths and secrets").
audit:
	python3 -m venv .audit-venv && .audit-venv/bin/pip install -q pip-audit==2.10.1
	.audit-venv/bin/pip-audit -r constraints.txt --no-deps --disable-pip --strict
