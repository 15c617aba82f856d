#!/usr/bin/env bash
# Fill a folder of wheels for bench/gpu_setup.sh --wheels, on a machine that reaches PyPI, with the versions
# pinned in constraints.txt (set `train`) or constraints-cuda.txt (set `full`), for a GPU machine that reaches
# no package registry.
#
#   bash bench/gpu_wheels.sh [--python X.Y] [--set train|full] [--dest DIR] [--list] [--list-omitted]
#
#   --python X.Y    target interpreter (default: the version of the python that runs pip here, .venv's)
#   --set train     (default) what the training path needs besides torch: `python -m bench.gpu_mfu`,
#                   `python -m bench.kill_resume`, lifecycle.tasks.train.{launch,trainer} and the ranks, i.e.
#                   DeepSpeed and its requirements, pydantic and its requirements, pytest (bench.gpu_mfu's corpus
#                   comes from tests/train/test_train.py), setuptools (lifecycle is installed with
#                   --no-build-isolation). No torch: the target machine has a CUDA build of it.
#   --set full      every package of constraints-cuda.txt, the CUDA build of torch and its nvidia-* wheels
#                   included (several GB), for a GPU machine without torch.
#   --dest DIR      the folder (default wheelhouse/, git-ignored)
#   --list          print the pins of the set (name==version, one a line) and download nothing
#   --list-omitted  print the distributions the train set leaves to the target machine, one a line
#
# Wheels are fetched with `pip download --only-binary=:all: --no-deps` for manylinux x86_64 and the target
# CPython; DeepSpeed (an sdist only on PyPI) is built here as a pure-Python wheel (no ops: they are JIT-built
# on the GPU machine when used), which needs torch in the python that runs this script (.venv's). Its recorded
# build accelerator (cpu here) matters only for prebuilt ops, of which it has none; DS_ACCELERATOR picks at run time.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The train set, from what the training path imports (tests/test_install.py checks that this list covers
# every non-stdlib module that importing the trainer, the launcher, bench.gpu_mfu and bench.kill_resume loads,
# less OMITTED): deepspeed and its Requires-Dist, pydantic's closure, the optional imports that run when present
# (pyarrow's cloudpickle, deepspeed's tabulate and its wcwidth; not deepspeed's mlflow nor pyarrow's pandas), tokenizers (the test
# corpus of bench.gpu_mfu/kill_resume is tokenized; its huggingface-hub requirement is never imported there),
# pytest's closure (that corpus comes from tests/train/test_train.py), and cheap ones (pyyaml, safetensors,
# filelock). A 3.12 folder is about 14 MB. Not NVIDIA DALI (clip_train.loader: dali, bench/gpu_figures.sh's `dali`
# step): its wheel alone is 199 MB, far over what a GPU lease carries (64 MiB); `full`, every pin of the CUDA lock, has it.
TRAIN=(
    deepspeed hjson einops msgpack ninja packaging psutil py-cpuinfo tqdm
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    cloudpickle pyyaml safetensors tabulate wcwidth filelock tokenizers
    pytest pluggy iniconfig pygments
)
# Left to the target machine (it has them, with its CUDA torch): torch and what it requires (the nvidia-*
# libraries, triton, sympy, networkx, jinja2, fsspec, ...), and numpy and pyarrow (tens of MB as wheels: the
# folder must travel in under 64 MiB). bench/gpu_setup.sh's final check imports the trainer, which needs both.
OMITTED=(torch triton 'nvidia-*' sympy mpmath networkx jinja2 markupsafe fsspec numpy pyarrow)
# setuptools is not pinned by constraints.txt (pip freeze leaves it out); pyproject.toml needs >=77.
SETUPTOOLS_PIN="setuptools==84.2.1"

PYBIN=${PYBIN:-}
if [[ -z $PYBIN ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYBIN=$ROOT/.venv/bin/python; else PYBIN=python3; fi
fi
TARGET_PY=""
SET=train
DEST=$ROOT/wheelhouse
LIST=0
LIST_OMITTED=0
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --python) TARGET_PY=${2:?--python needs X.Y}; shift 2 ;;
        --set) SET=${2:?--set needs train or full}; shift 2 ;;
        --dest) DEST=${2:?--dest needs a folder}; shift 2 ;;
        --list) LIST=1; shift ;;
        --list-omitted) LIST_OMITTED=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ $LIST_OMITTED == 1 ]]; then printf '%s\n' "${OMITTED[@]}"; exit 0; fi
case $SET in
    train) LOCK=$ROOT/constraints.txt ;;
    full) LOCK=$ROOT/constraints-cuda.txt ;;
    *) echo "gpu_wheels.sh: --set must be train or full, not $SET" >&2; exit 2 ;;
esac
[[ -f $LOCK ]] || { echo "gpu_wheels.sh: $LOCK is missing (make lock-cuda writes constraints-cuda.txt)" >&2; exit 1; }
[[ -n $TARGET_PY ]] || TARGET_PY=$("$PYBIN" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $TARGET_PY =~ ^3\.[0-9]+$ ]] || { echo "gpu_wheels.sh: --python wants X.Y, e.g. 3.12, not $TARGET_PY" >&2; exit 2; }
TAG=cp${TARGET_PY/./}

# name==version for each name of the set, from the lock (names compared PEP 503-normalised)
PINS=$("$PYBIN" - "$LOCK" "$SET" "$SETUPTOOLS_PIN" "${TRAIN[@]}" <<'EOF'
import re, sys
lock, which, setuptools_pin, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
pins = {}
for line in open(lock):
    line = line.split("#")[0].strip()
    if line:
        name, _, version = line.partition("==")
        pins[norm(name)] = f"{name.strip()}=={version.strip()}"
if which == "full":
    names = list(pins)
missing = [n for n in names if norm(n) not in pins]
if missing:
    sys.exit(f"gpu_wheels.sh: not pinned in {lock}: {' '.join(missing)}")
out = [pins[norm(n)] for n in names]
if not any(norm(p.split("==")[0]) == "setuptools" for p in out):
    out.append(setuptools_pin)
print("\n".join(out))
EOF
)
if [[ $LIST == 1 ]]; then echo "$PINS"; exit 0; fi

mkdir -p "$DEST"
# glibc 2.28 and older (pip does not widen --platform itself): the nvidia-* wheels are tagged 2_27, 2_25, 2_18, ...
PLATFORMS=()
for minor in $(seq 28 -1 5); do PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
            --platform linux_x86_64 --platform any)
DOWNLOAD=(--only-binary=:all: --no-deps --python-version "$TARGET_PY" --implementation cp
          --abi "$TAG" --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DEST")
BINARY=() SOURCE=()
while read -r pin; do
    case ${pin%%==*} in deepspeed) SOURCE+=("$pin") ;; *) BINARY+=("$pin") ;; esac
done <<< "$PINS"

echo "gpu_wheels.sh: ${#BINARY[@]} wheels for CPython $TARGET_PY ($SET set, pins from ${LOCK##*/}) into $DEST"
if ! "$PYBIN" -m pip download --quiet "${DOWNLOAD[@]}" "${BINARY[@]}"; then
    # one at a time, to name the ones PyPI has no wheel of for this target; those are built here below
    for pin in "${BINARY[@]}"; do
        "$PYBIN" -m pip download --quiet "${DOWNLOAD[@]}" "$pin" 2>/dev/null || SOURCE+=("$pin")
    done
fi

# sdist-only packages: build a wheel here; it must be pure Python (or built for the target CPython)
for pin in ${SOURCE[@]+"${SOURCE[@]}"}; do
    echo "gpu_wheels.sh: building $pin (no binary wheel on PyPI)"
    tmp=$(mktemp -d)
    flags=()
    [[ ${pin%%==*} == deepspeed ]] && flags=(--no-build-isolation)  # its setup.py imports torch
    DS_BUILD_OPS=0 "$PYBIN" -m pip wheel --quiet --no-deps ${flags[@]+"${flags[@]}"} -w "$tmp" "$pin"
    for whl in "$tmp"/*.whl; do
        case ${whl##*/} in
            *-py3-none-any.whl|*-py2.py3-none-any.whl|*-"$TAG"-"$TAG"-*x86_64.whl) mv "$whl" "$DEST"/ ;;
            *) echo "gpu_wheels.sh: ${whl##*/} is not installable on CPython $TARGET_PY; build it there" >&2
               rm -rf "$tmp"; exit 1 ;;
        esac
    done
    rm -rf "$tmp"
done

# every pin has its wheel in DEST
# shellcheck disable=SC2086  # one pin a word
"$PYBIN" - "$DEST" $PINS <<'EOF'
import os, re, sys
dest, pins = sys.argv[1], sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {tuple(norm(x) for x in f.split("-")[:2]) for f in os.listdir(dest) if f.endswith(".whl")}
missing = [p for p in pins if tuple(norm(x) for x in p.split("==")) not in have]
if missing:
    sys.exit(f"gpu_wheels.sh: no wheel in {dest} for {' '.join(missing)}")
EOF
size=$(du -sh "$DEST" | cut -f1)
echo "gpu_wheels.sh: $DEST holds $(ls "$DEST"/*.whl | wc -l) wheels, $size"
