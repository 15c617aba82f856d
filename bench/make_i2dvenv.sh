#!/usr/bin/env bash
# Creates the separate virtual environment bench/image_resize.py runs img2dataset's resizer in (never install it
# into .venv). Usage: bench/make_i2dvenv.sh [DIR]   (default /tmp/i2dvenv; the benchmark reads I2DVENV)
# img2dataset without its dependencies (its package __init__ imports the downloader's: wandb, fire, fsspec...);
# the resizer itself needs albumentations and OpenCV, which come with theirs.
set -euo pipefail
DIR="${1:-${I2DVENV:-/tmp/i2dvenv}}"
python3.11 -m venv "$DIR"
"$DIR/bin/pip" install -q --no-deps "img2dataset==1.47.0"
"$DIR/bin/pip" install -q "albumentations==1.4.24" "opencv-python-headless==4.10.0.84" "numpy==1.26.4"
"$DIR/bin/python" -c "import albumentations, cv2; print('img2dataset venv ready:', '$DIR')"
