#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh). Host tests use the ComfyUI at $COMFYUI_PATH,
# default ./.comfyui; without one they are skipped and pytest says so.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${COMFYUI_PATH:-}" ] && [ -f .comfyui/main.py ]; then
  export COMFYUI_PATH="$PWD/.comfyui"
fi
exec .venv/bin/python -m pytest tests -rs "$@"
