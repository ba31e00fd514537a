#!/usr/bin/env bash
# Set up the pack's development environment and run the main job.
#
#   bash scripts/setup.sh            # .venv + dependencies + ComfyUI host, then the main job
#   bash scripts/setup.sh --no-run   # set up only
#
# The main job (benchmarks/h3_reference_run.py --first-contact; it writes first-run.json) picks its run from
# the device. On a CUDA GPU: two full-width MiniMax H3 blocks (the real shapes) in both weight formats the
# workflows load (bf16, int8_convrot), stock ComfyUI and the pack timed interleaved on that GPU, at 37,810
# tokens (the bundled workflows' length) and 8,192 as its free memory allows; it prints one table: ms per
# block, the ratio, whether the outputs are stock's bits, peak extra memory. Where more than 80 GiB is free
# it then samples the full-size model too (first-run-full.json). On a CPU, or a GPU without room for two
# blocks: a tiny random-weight H3 sampled through ComfyUI's nodes, stock and both layouts, and whether the
# latents agree.
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
  echo "setup: main job: H3 blocks on this GPU, stock beside the pack (on a CPU: a tiny H3 sampled); first-run.json"
  # 21 interleaved reps a block (the harness's default is 9): steadier ratios for a few seconds more.
  # Progress lines stay, their indented details (per rep, per step) go: the JSON keeps every number.
  COMFYUI_PATH=$PWD/.comfyui .venv/bin/python -m benchmarks.h3_reference_run --first-contact --backend auto \
    --reps 21 --out first-run.json | grep -v '^\[h3-bench [0-9:]*\]   '
  # the run's plan says whether the full-size model fits (more than 80 GiB free): then it is sampled too
  if .venv/bin/python -c "import json, sys; sys.exit(not json.load(open('first-run.json'))['first_contact']['full_model'])"; then
    COMFYUI_PATH=$PWD/.comfyui .venv/bin/python -m benchmarks.h3_reference_run --backend auto --out first-run-full.json
  fi
fi
