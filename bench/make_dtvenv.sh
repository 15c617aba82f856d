#!/usr/bin/env bash
# Creates the separate virtual environment the datatrove comparisons run in (never install datatrove into .venv).
# Usage: bench/make_dtvenv.sh [DIR]   (default /tmp/dtvenv; the benchmarks read DTVENV, default /tmp/dtvenv)
set -euo pipefail
DIR="${1:-${DTVENV:-/tmp/dtvenv}}"
python3.11 -m venv "$DIR"
"$DIR/bin/pip" install -q "datatrove==0.10.1" "spacy==3.8.18"
"$DIR/bin/python" -c "import datatrove, spacy; print('datatrove venv ready:', '$DIR')"
