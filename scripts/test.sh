#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh). Host tests use the ComfyUI at $COMFYUI_PATH,
# default ./.comfyui; without one they are skipped and pytest says so. Without arguments it also runs
# scripts/test_kitchen_releases.sh (each verified comfy-kitchen release installed in turn; needs the package index).
# The ahead-of-time builds for every GPU architecture (tests marked aot, about two minutes) are CI's own step
# (.ci/run); run them alone with `.venv/bin/python -m pytest tests/unit/test_triton_aot.py -m aot`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${COMFYUI_PATH:-}" ] && [ -f .comfyui/main.py ]; then
  export COMFYUI_PATH="$PWD/.comfyui"
fi
if [ "$#" = 0 ]; then
  # without arguments: also the int8 route's CPU checks against each comfy-kitchen release it is verified on, in
  # their own processes beside the suite (their output follows the suite's)
  releases_log=$(mktemp)
  trap 'rm -f "$releases_log"' EXIT
  bash scripts/test_kitchen_releases.sh >"$releases_log" 2>&1 &
  releases=$!
fi
status=0
.venv/bin/python -m pytest tests -rs -m "not aot" "$@" || status=$?
if [ "$#" = 0 ]; then
  wait "$releases" || status=1
  cat "$releases_log"
fi
exit "$status"
