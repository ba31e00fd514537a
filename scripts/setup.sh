#!/usr/bin/env bash
# Set up the pack's development environment and run the main job.
#
#   bash scripts/setup.sh            # .venv + dependencies + ComfyUI host, then the main job
#   bash scripts/setup.sh --no-run   # set up only
#
# The main job samples MiniMax H3 through ComfyUI's own nodes with the pack's node in both layouts
# (and stock attention beside them) and prints which attention ran and whether the latents agree:
# the full-size model on a CUDA GPU with room for it (~80 GB), a tiny random-weight H3 elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON_BIN:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
# torch belongs to ComfyUI: install it only when the venv has none (2.14.1 + torchvision 0.29.1 lie on
# this project's machines' disk; elsewhere pip takes them from PyPI).
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  $PIP install -q "torch==2.14.1" "torchvision==0.29.1"
fi
# ComfyUI imports torchaudio at start-up (comfy/sd.py, the H3 nodes). 2.11.1 is pure Python and runs with
# torch 2.14.1; --no-deps keeps it from pulling another torch.
if ! .venv/bin/python -c "import torchaudio" 2>/dev/null; then
  $PIP install -q --no-deps "torchaudio==2.11.1"
fi
$PIP install -q -r requirements.txt -r requirements-test.txt

# The browser test drives Debian's Chromium with playwright-core (no browser download). Installed when this
# machine can (root with apt-get); without them that one test is skipped and says why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "setup: could not install chromium"
fi
if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -qq nodejs npm >/dev/null || echo "setup: could not install node/npm"
fi
if command -v npm >/dev/null 2>&1; then
  (cd tests/browser && npm ci --no-audit --no-fund --silent) || echo "setup: npm ci failed in tests/browser"
fi

# A real ComfyUI to run the node and host tests against.
HOST_READY=1
PYTHON=.venv/bin/python bash scripts/setup_comfyui_host.sh || HOST_READY=0
if [ "$HOST_READY" = 0 ]; then
  echo "setup: no ComfyUI host (reason above): host tests fail under CI=true and are skipped otherwise"
fi

if [ "${1:-}" != "--no-run" ]; then
  if [ "$HOST_READY" = 0 ]; then
    echo "setup: the main job needs the ComfyUI host; not run"
    exit 1
  fi
  # full size only where the GPU has room for the 33 B-parameter model and its activations
  if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.mem_get_info()[0] > 80 * 2**30 else 1)"; then
    COMFYUI_PATH=$PWD/.comfyui .venv/bin/python -m benchmarks.h3_reference_run --backend auto --out first-run.json
  else
    echo "setup: main job: a tiny random-weight H3 sampled on the CPU through ComfyUI's nodes, stock and both layouts"
    COMFYUI_PATH=$PWD/.comfyui .venv/bin/python -m benchmarks.h3_reference_run --tiny --device cpu --backend auto \
      --sections sampling_2_step --stock-sampling --out first-run.json | grep -v '^\[h3-bench'
  fi
fi
