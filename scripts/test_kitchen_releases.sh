#!/usr/bin/env bash
# The int8 route's CPU checks (tests/unit/test_int8_release.py) against each comfy-kitchen release it is verified
# on, installed in turn beside .venv's own (pip --target into a temporary folder, put first on PYTHONPATH), which
# stays as it is. Run after scripts/setup.sh:
#
#   bash scripts/test_kitchen_releases.sh              # every release in kernels/kitchen.py's RELEASES
#   bash scripts/test_kitchen_releases.sh 0.2.40       # the releases named
#
# Prints one line per release (release, passed/failed) and exits non-zero when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
if [ "$#" -gt 0 ]; then
  releases=("$@")
else
  read -r -a releases < <($PY -c "from devkit.pack import submodule; \
print(' '.join(submodule('kernels.kitchen').KITCHEN_VERSIONS))")
fi
if [ "${#releases[@]}" = 0 ]; then  # the lookup failed: say so rather than pass having checked nothing
  echo "[Sage Strided NHD] no comfy-kitchen release to check (kernels/kitchen.py's KITCHEN_VERSIONS unreadable?)"
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

declare -A result
for release in "${releases[@]}"; do
  target="$work/comfy-kitchen-$release"
  log="$work/$release.log"
  echo "[Sage Strided NHD] comfy-kitchen $release: installing beside .venv's own and running the CPU checks"
  if ! $PY -m pip install -q --no-deps --target "$target" "comfy-kitchen==$release" >"$log" 2>&1; then
    result[$release]="failed (pip could not install it: $(tail -n 1 "$log"))"
    continue
  fi
  # the release under test must be the one imported, by module and by metadata
  if ! PYTHONPATH="$target" $PY -c "import sys, importlib.metadata as m, comfy_kitchen; \
sys.exit(0 if m.version('comfy-kitchen') == '$release' and comfy_kitchen.__file__.startswith('$target') else 1)"; then
    result[$release]="failed (the installed comfy-kitchen $release is not the one Python imports)"
    continue
  fi
  if PYTHONPATH="$target" $PY -m pytest tests/unit/test_int8_release.py tests/unit/test_int8_w4a8.py tests/host/test_format_matrix.py \
    tests/host/test_format_server.py -q -p no:cacheprovider >"$log" 2>&1; then
    result[$release]="passed ($(tail -n 1 "$log" | tr -d '='))"
  else
    tail -n 40 "$log"
    result[$release]="failed ($(tail -n 1 "$log" | tr -d '='))"
  fi
done

status=0
echo "[Sage Strided NHD] int8 route against comfy-kitchen releases (CPU checks):"
for release in "${releases[@]}"; do
  printf '  comfy-kitchen %-8s %s\n' "$release" "${result[$release]}"
  case "${result[$release]}" in passed*) ;; *) status=1 ;; esac
done
exit $status
