#!/usr/bin/env bash
# Creates the separate virtual environment the datatrove comparisons run in (never install datatrove into .venv).
# Usage: bench/make_dtvenv.sh [DIR]   (default /tmp/dtvenv; the benchmarks read DTVENV, default /tmp/dtvenv)
set -euo pipefail
DIR="${1:-${DTVENV:-/tmp/dtvenv}}"
python3.11 -m venv "$DIR"
# tokenizers: `datatrove.pipeline.dedup` imports it at package import; xxhash: MinhashConfig's default hash;
# regex: datatrove.utils.text (MinHash shingling); orjson: JsonlReader (bench/pipeline_throughput.py)
"$DIR/bin/pip" install -q "datatrove==0.10.1" "spacy==3.8.18" "tokenizers==0.23.3" "xxhash==3.8.2" "orjson==3.13.0" "regex==2026.11.15"
"$DIR/bin/python" -c "import datatrove.pipeline.dedup, spacy, orjson; print('datatrove venv ready:', '$DIR')"
