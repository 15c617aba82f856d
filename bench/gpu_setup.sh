#!/usr/bin/env bash
# Prepare a fresh GPU machine for the training path (`python -m bench.gpu_mfu`, `python -m bench.kill_resume
# --accelerator cuda`, `lifecycle run` with `train.engine.accelerator: cuda`) from the project's pinned files.
#
#   bash bench/gpu_setup.sh [--wheels DIR] [--venv PATH] [--exact] [--allow-cpu]
#
# Online (no --wheels): `make install CUDA=1` (constraints-cuda.txt: torch from PyPI, its CUDA build) into
#   --venv (default .venv).
# Offline (--wheels DIR, a folder filled by bench/gpu_wheels.sh on a machine that reaches PyPI; nothing is
#   fetched): if python3 (or $PYTHON) already imports a CUDA build of torch that sees a GPU, that torch is kept:
#   a venv (default /tmp/lifecycle-venv) with --system-site-packages gets only the packages of the train set
#   (`bash bench/gpu_wheels.sh --list`) that are missing, at their pinned versions, from DIR. Otherwise every
#   package of constraints-cuda.txt, torch included, is installed from DIR (fill it with `--set full`).
#   Then lifecycle itself: `pip install --no-deps --no-build-isolation -e .`.
#
#   --exact      also replace the machine's packages whose version differs from the pin (default: keep them,
#                naming each)
#   --allow-cpu  accept a CPU build of torch (to try this script on a machine without a GPU)
#
# Ends with one line: python, torch (version, CUDA version, GPU), deepspeed; exit 1 naming what is missing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
WHEELS=""
VENV=""
EXACT=0
ALLOW_CPU=0
PY3=${PYTHON:-python3}
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
        --venv) VENV=${2:?--venv needs a path}; shift 2 ;;
        --exact) EXACT=1; shift ;;
        --allow-cpu) ALLOW_CPU=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_setup.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
say() { echo "gpu_setup.sh: $*"; }
die() { echo "gpu_setup.sh: $*" >&2; exit 1; }
[[ $ALLOW_CPU == 1 ]] && export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}

check() {  # the one-line summary; fails naming what is missing
    "$1" - "$ALLOW_CPU" <<'EOF'
import importlib, platform, sys
allow_cpu = sys.argv[1] == "1"
missing = []
for mod in ("torch", "deepspeed", "lifecycle.tasks.train.trainer", "lifecycle.tasks.train.launch"):
    try:
        importlib.import_module(mod)
    except Exception as e:  # an ImportError, or a broken install raising something else
        missing.append(f"{mod} ({type(e).__name__}: {e})")
if missing:
    sys.exit("gpu_setup.sh: cannot import " + "; ".join(missing) + " (with --wheels, a package the machine had at "
             "another version is kept: --exact installs the pinned ones over them)")
import deepspeed, torch
if torch.version.cuda is None and not allow_cpu:
    sys.exit(f"gpu_setup.sh: torch {torch.__version__} is a CPU build (from {torch.__file__})")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
if gpu == "no GPU" and not allow_cpu:
    sys.exit(f"gpu_setup.sh: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__} ({build}) on {gpu}, "
      f"deepspeed {deepspeed.__version__}")
EOF
}

if [[ -z $WHEELS ]]; then
    VENV=${VENV:-.venv}
    say "online: make install CUDA=1 VENV=$VENV"
    make install CUDA=1 VENV="$VENV"
    check "$VENV/bin/python"
    exit 0
fi

[[ -d $WHEELS ]] || die "--wheels $WHEELS is not a folder"
WHEELS=$(cd "$WHEELS" && pwd)
VENV=${VENV:-/tmp/lifecycle-venv}
command -v "$PY3" >/dev/null || die "no $PY3 on PATH (set PYTHON=/path/to/python3)"
# The machine's torch: keep it when it is a CUDA build that sees a GPU (or any build, with --allow-cpu).
TORCH=$("$PY3" - "$ALLOW_CPU" <<'EOF' 2>/dev/null || true
import sys
import torch
ok = torch.version.cuda is not None and torch.cuda.is_available()
if ok or sys.argv[1] == "1":
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    print(f"torch {torch.__version__} ({build}) from {torch.__file__.rsplit('/torch/', 1)[0]}")
EOF
)
if [[ -n $TORCH ]]; then
    SET=train
    say "keeping the machine's $TORCH"
else
    SET=full
    ls "$WHEELS"/torch-*.whl >/dev/null 2>&1 \
        || die "$PY3 has no CUDA build of torch that sees a GPU, and $WHEELS has no torch wheel: fill it with bench/gpu_wheels.sh --set full"
    say "$PY3 has no CUDA build of torch that sees a GPU: installing torch and everything else from $WHEELS"
fi
PINS=$(PYBIN=$PY3 bash bench/gpu_wheels.sh --list --set "$SET")

if [[ ! -x $VENV/bin/python ]]; then
    flags=()
    [[ $SET == train ]] && flags=(--system-site-packages)
    "$PY3" -m venv "${flags[@]}" "$VENV" 2>/dev/null || "$PY3" -m venv --without-pip "${flags[@]}" "$VENV"
    if [[ $SET == train ]]; then
        # $PY3 itself a virtualenv (or conda env): --system-site-packages reaches only its base interpreter's
        # packages, so its own site-packages (where its torch is) go on the path through a .pth file
        "$VENV/bin/python" - "$PY3" <<'EOF'
import json, site, subprocess, sys
theirs = json.loads(subprocess.check_output([sys.argv[1], "-c", "import json, site, sys; "
                    "print(json.dumps([p for p in site.getsitepackages() if sys.prefix != sys.base_prefix]))"]))
ours = set(sys.path)
extra = [p for p in theirs if p not in ours]
if extra:
    open(site.getsitepackages()[0] + "/_lifecycle_base.pth", "w").write("\n".join(extra) + "\n")
EOF
    fi
fi
VPY=$VENV/bin/python
if "$VPY" -m pip --version >/dev/null 2>&1; then PIP=("$VPY" -m pip); else PIP=("$PY3" -m pip --python "$VPY"); fi

# which pins to install: missing ones, and (--exact, or setuptools older than pyproject.toml's >=77) differing ones
# shellcheck disable=SC2086  # one pin a word
TODO=$("$VPY" - "$EXACT" $PINS <<'EOF'
import importlib.metadata as md, sys
exact, pins = sys.argv[1] == "1", sys.argv[2:]
todo, kept = [], []
for pin in pins:
    name, version = pin.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        todo.append(pin)
        continue
    old_setuptools = name == "setuptools" and int(have.split(".")[0]) < 77
    if have != version and (exact or old_setuptools):
        todo.append(pin)
    elif have != version:
        kept.append(f"{name} {have} (pin {version})")
if kept:
    print("gpu_setup.sh: kept the machine's " + ", ".join(kept) + " (--exact replaces them)", file=sys.stderr)
print(" ".join(todo))
EOF
)
if [[ -n $TODO ]]; then
    say "installing from $WHEELS: $TODO"
    # shellcheck disable=SC2086
    PIP_CONFIG_FILE=/dev/null "${PIP[@]}" install --quiet --no-index --find-links "$WHEELS" --no-deps $TODO
else
    say "every pinned package of the $SET set is in place"
fi
# pyproject.toml's requires-python is the CPU install's (3.11); the GPU machine's python may be newer
PIP_CONFIG_FILE=/dev/null "${PIP[@]}" install --quiet --no-index --no-deps --no-build-isolation \
    --ignore-requires-python -e "$ROOT"
check "$VPY"
