#!/usr/bin/env bash
# Make a runnable ComfyUI host for the pack's host tests, if none is there yet.
#
#   COMFYUI_PATH  where the host lives            (default: <repo>/.comfyui, git-ignored)
#   PYTHON        python of the venv to install into (default: <repo>/.venv/bin/python)
#   COMFYUI_GIT   bare git dir of a ComfyUI snapshot (default: /work/.mirror/kat3ri+ComfyUI/repo)
#
# Source of the ComfyUI tree, in order:
#   1. an existing tree at $COMFYUI_PATH (left as it is),
#   2. the bare git dir $COMFYUI_GIT, extracted file by file (blobs missing from the snapshot are skipped),
#   3. `git clone` of upstream ComfyUI at a pinned commit that has MiniMax H3 (needs network access to GitHub).
# Then ComfyUI's Python requirements go into $PYTHON's environment, torch/torchvision/torchaudio excluded and
# the installed torch pinned, so torch is never reinstalled or upgraded. Finally the pack is linked into
# <host>/custom_nodes/comfyui-sage-strided-nhd.
#
# Re-runs are quick: a stamp file records what was installed. Exit status 0 means a host is ready;
# 2 means no host could be made (the reason is printed), so callers can report and skip host tests.
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOST="${COMFYUI_PATH:-$REPO/.comfyui}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
# absolute, so it still resolves after the `cd "$HOST"` of the smoke check
case "$PY" in /*) ;; */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
MIRROR="${COMFYUI_GIT:-/work/.mirror/kat3ri+ComfyUI/repo}"
UPSTREAM_URL="https://github.com/comfyanonymous/ComfyUI.git"
PINNED_COMMIT="0f1fa67ad8a68b62c65ebc97a7bf485df2459c3a"   # ComfyUI 0.33.0 with comfy/ldm/minimax (H3)
PACK_LINK="$HOST/custom_nodes/comfyui-sage-strided-nhd"
STAMP="$HOST/.sage_nhd_host_stamp"

say() { echo "[setup_comfyui_host] $*"; }
no_host() { say "NO COMFYUI HOST: $*"; exit 2; }

have_tree() { [ -f "$HOST/main.py" ] && [ -f "$HOST/comfy/ldm/minimax/model.py" ]; }

extract_from_bare_git() {
    # git archive fails on snapshots with missing blobs, so write each present blob ourselves.
    local commit
    commit="$(git --git-dir="$MIRROR" rev-parse HEAD 2>/dev/null)" || return 1
    say "extracting ComfyUI $commit from $MIRROR"
    mkdir -p "$HOST"
    "$PY" - "$MIRROR" "$commit" "$HOST" <<'EOF' || return 1
import os, subprocess, sys
git_dir, commit, dest = sys.argv[1:4]
tree = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "-z", commit],
                      check=True, capture_output=True).stdout.split(b"\0")
entries = []
for line in tree:
    if not line:
        continue
    meta, path = line.split(b"\t", 1)
    mode, kind, sha = meta.split()
    if kind == b"blob":
        entries.append((mode, sha, path.decode()))
batch = subprocess.Popen(["git", "--git-dir", git_dir, "cat-file", "--batch"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
written = skipped = 0
for mode, sha, path in entries:
    batch.stdin.write(sha + b"\n")
    batch.stdin.flush()
    header = batch.stdout.readline().split()
    if len(header) < 2 or header[1] == b"missing":
        skipped += 1
        continue
    data = batch.stdout.read(int(header[2]))
    batch.stdout.read(1)  # trailing newline
    target = os.path.join(dest, path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if mode == b"120000":
        if os.path.lexists(target):
            os.remove(target)
        os.symlink(data.decode(), target)
    else:
        with open(target, "wb") as f:
            f.write(data)
        if mode == b"100755":
            os.chmod(target, 0o755)
    written += 1
batch.stdin.close()
batch.wait()
print(f"[setup_comfyui_host] wrote {written} files, skipped {skipped} blobs missing from the snapshot")
EOF
    echo "$commit" > "$HOST/.sage_nhd_source_commit"
}

clone_upstream() {
    # Needs network access to GitHub; on machines without it this step fails and no host is made.
    command -v git >/dev/null || return 1
    say "cloning $UPSTREAM_URL at $PINNED_COMMIT (needs network)"
    local tmp="$HOST.clone-tmp"
    rm -rf "$tmp"
    git clone --quiet --filter=blob:none --no-checkout "$UPSTREAM_URL" "$tmp" 2>/dev/null || { rm -rf "$tmp"; return 1; }
    git -C "$tmp" checkout --quiet "$PINNED_COMMIT" 2>/dev/null || { rm -rf "$tmp"; return 1; }
    mkdir -p "$HOST"
    cp -a "$tmp/." "$HOST/" && rm -rf "$tmp"
    echo "$PINNED_COMMIT" > "$HOST/.sage_nhd_source_commit"
}

# --- 0. python -------------------------------------------------------------------------------------
[ -x "$PY" ] || no_host "python '$PY' not found (set PYTHON to the venv's python)"
"$PY" -c "import torch" 2>/dev/null || no_host "torch is not importable by $PY (install torch first; this script never installs it)"

# --- 1. ComfyUI tree -------------------------------------------------------------------------------
if have_tree; then
    say "ComfyUI tree present at $HOST"
elif [ -d "$MIRROR" ] && extract_from_bare_git && have_tree; then
    :
elif clone_upstream && have_tree; then
    :
else
    no_host "no ComfyUI tree at $HOST, no usable snapshot at $MIRROR, and cloning upstream failed (no network?)"
fi

# --- 2. requirements (torch kept as installed) -----------------------------------------------------
req_key="$("$PY" -c 'import sys,torch; print(sys.executable, torch.__version__)') $(md5sum < "$HOST/requirements.txt" | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$req_key" ]; then
    say "requirements already installed for this python ($req_key)"
else
    tmpdir="$(mktemp -d)"
    # ComfyUI's essential requirements (the part above '#non essential'), minus the torch family,
    # plus pydantic which comfy_api needs.
    sed -n '/^#non essential/q;p' "$HOST/requirements.txt" \
        | grep -v -E '^\s*(torch|torchvision|torchaudio)\s*([<>=~!].*)?$' \
        | grep -v -E '^\s*(#|$)' > "$tmpdir/req.txt"
    grep -E '^pydantic' "$HOST/requirements.txt" >> "$tmpdir/req.txt"
    grep -q '^comfy-kitchen' "$tmpdir/req.txt" || echo "comfy-kitchen==0.2.31" >> "$tmpdir/req.txt"
    # pin the installed torch (and torchvision) so no requirement can pull another build
    "$PY" - > "$tmpdir/pin.txt" <<'EOF'
import torch
# the public version ("2.14.1", no "+cu130"): pip matches it against the installed local build
print(f"torch=={torch.__version__.split('+')[0]}")
try:
    import torchvision
    print(f"torchvision=={torchvision.__version__.split('+')[0]}")
except Exception:
    pass
EOF
    say "installing ComfyUI requirements into $("$PY" -c 'import sys; print(sys.prefix)') (torch pinned: $(tr '\n' ' ' < "$tmpdir/pin.txt"))"
    if "$PY" -m pip install --disable-pip-version-check -q -r "$tmpdir/req.txt" -c "$tmpdir/pin.txt"; then
        echo "$req_key" > "$STAMP"
    else
        rm -rf "$tmpdir"
        no_host "pip could not install ComfyUI's requirements into $PY"
    fi
    rm -rf "$tmpdir"
fi

# --- 3. the pack in custom_nodes -------------------------------------------------------------------
mkdir -p "$HOST/custom_nodes"
if [ -L "$PACK_LINK" ] && [ "$(readlink "$PACK_LINK")" = "$REPO" ]; then
    :
else
    rm -rf "$PACK_LINK"
    ln -s "$REPO" "$PACK_LINK"
fi

# --- 4. smoke check: ComfyUI's core imports with this python ---------------------------------------
if ! (cd "$HOST" && "$PY" -c "from comfy.cli_args import args; args.cpu = True; import comfy.ldm.minimax.model, comfy_api.latest" >/dev/null 2>"$HOST/.sage_nhd_import_error"); then
    no_host "ComfyUI at $HOST does not import with $PY: $(tail -n 3 "$HOST/.sage_nhd_import_error")"
fi
say "ComfyUI host ready: COMFYUI_PATH=$HOST (pack linked at $PACK_LINK)"
exit 0
