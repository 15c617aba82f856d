# Two commands do everything on a fresh clone: `make demo` and `make test`.
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
PIP_ARGS  ?=
# On a machine whose pip does not already find the CPU build of torch, use e.g.
#   make demo PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
export DS_ACCELERATOR ?= cpu

.PHONY: install demo test bench clean-demo lock audit

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip==26.3"
	$(PY) -m pip install --quiet $(PIP_ARGS) -c constraints.txt -e ".[dev]"
	$(PY) -c "import torch, prefect.server.api.server, deepspeed, mlflow; assert torch.version.cuda is None, "a CUDA build of torch was installed""
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lifecycle run deploy/configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

bench: $(STAMP)
	$(PY) -m bench

clean-demo:
	-$(VENV)/bin/lifecycle down deploy/configs/demo.yaml
	rm -rf runs/demo

# Re-pin the whole environment after changing dependencies in pyproject.toml.
lock:
	$(PY) -m pip freeze --exclude-editable | sed -e 's/^torch==2.13.0+cpu$$/torch==2.13.0/' > constraints.txt

# Known vulnerabilities in the pinned versions (needs the PyPI JSON API or api.osv.dev; see README "Security").
audit:
	python3 -m venv .audit-venv && .audit-venv/bin/pip install -q pip-audit==2.10.1
	.audit-venv/bin/pip-audit -r constraints.txt --no-deps --disable-pip --strict
