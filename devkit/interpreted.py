"""Run a test's Triton checks under the CPU interpreter (``TRITON_INTERPRET=1``) in a subprocess: the
flag must be set before a kernel is decorated, so it cannot be switched on in the test's own process.
The script gets the repo root on ``sys.path``, the pack imported, ``json`` and ``torch``, and reports
by calling ``report(results)``; ``run_interpreted`` returns those results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "RESULTS "
PREAMBLE = textwrap.dedent(f"""
    import json, sys
    sys.path.insert(0, {str(ROOT)!r})
    from devkit.pack import import_pack
    import_pack()
    import torch

    def report(results):
        print({MARK!r} + json.dumps(results))
""")


def run_interpreted(script: str, timeout: int = 900):
    """The results ``script`` (dedented Python) reported under the interpreter; fails loudly when the
    run failed or reported nothing."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])
