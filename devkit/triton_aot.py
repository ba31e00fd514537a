"""Compile every Triton kernel the runtime launches, as it launches it (devkit/triton_targets.py), ahead of time for
each target architecture down to a cubin: no GPU needed (Triton's own ptxas builds the cubin). Prints a table, kernel
by architecture: built or failed, and whether the runtime launches the kernel there (else its gate's reason).

    python -m devkit.triton_aot                    # every declared launch for sm80 ... sm121
    python -m devkit.triton_aot --arch 89 --arch 120 --json aot.json

Each run compiles afresh (a temporary Triton cache) in worker processes; exit status 0 even where a build failed:
the table is the result (tests/unit/test_triton_aot.py judges it against the runtime's gates)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from unittest import mock

from . import triton_targets
from .pack import submodule

MAX_WORKERS = 8  # each worker holds torch and Triton's compiler in memory (up to about 1 GiB)


@dataclass(frozen=True)
class Built:
    """One launch compiled for one architecture."""

    name: str             # Launch.name: kernel[label]
    arch: int
    ok: bool
    error: str            # the first line of the root error ('' when built)
    seconds: float
    cubin_bytes: int
    launched: bool        # whether the runtime launches it on ``arch`` (no gate of the pack's: where its call is taken)
    gate: str             # the runtime's reason where it does not ('' where it does)
    build_gate: bool      # that reason is a declared build capability (the kernel is expected not to build)


def _root_message(exc: BaseException) -> str:
    """The innermost cause's first non-empty line, after the innermost Triton function named on the way (Triton
    wraps an error in one CompilationError per function, each starting with the source position)."""
    where = ""
    while True:
        where = next(iter(re.findall(r"^def (\w+)\(", str(exc), re.M)), where)
        if exc.__cause__ is None and exc.__context__ is None:
            break
        exc = exc.__cause__ or exc.__context__
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (f"in {where}: " if where else "") + f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def compile_launch(launch: triton_targets.Launch, arch: int):
    """The cubin's size in bytes of ``launch`` built for ``arch``, or the root error's first line."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = getattr(submodule(f"kernels.{launch.module}"), launch.kernel)
    signature = triton_targets.full_signature(fn, launch)
    # pointers are 16-byte aligned, as every torch allocation and the JIT's specialisation of them are
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values()) if ty.startswith("*")}
    source = triton.compiler.ASTSource(fn, signature, dict(launch.constexprs), attrs)
    try:
        options = {"num_warps": launch.num_warps}
        if launch.num_stages is not None:
            options["num_stages"] = launch.num_stages
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # the build's own failure is the result
        return 0, _root_message(exc)
    return len(kernel.asm["cubin"]), ""


def _build_one(launch: triton_targets.Launch, arch: int, gate: triton_targets.Gate | None) -> Built:
    start = time.perf_counter()
    size, error = compile_launch(launch, arch)
    return Built(launch.name, arch, not error and size > 0, error, round(time.perf_counter() - start, 2), size,
                 gate is None, gate.reason if gate else "", bool(gate and gate.build))


def build_all(archs=triton_targets.ARCHS, jobs: int | None = None) -> list[Built]:
    """Every declared launch built for every arch in ``archs``, in worker processes, a fresh cache."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("[Sage Strided NHD] unset TRITON_INTERPRET: the interpreter has no compiler to run")
    work = [(launch, arch, triton_targets.gate(launch, arch)) for arch in archs
            for launch in triton_targets.declared(arch)]
    context = multiprocessing.get_context("spawn")  # a fresh process: no MLIR or OpenMP state forked
    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache, \
            mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}):  # the workers' cache: nothing from earlier runs
        workers = jobs or min(os.cpu_count() or 1, MAX_WORKERS)
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            return list(pool.map(_build_one, *zip(*work)))


def _ptxas(archs) -> str:
    """The ptxas releases Triton builds these cubins with (its own, bundled in its wheel, unless overridden)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        versions = {}
        for arch in archs:
            versions.setdefault(get_ptxas(arch).version, []).append(f"sm{arch}")
        return "; ".join(f"ptxas {v}: {' '.join(a)}" for v, a in versions.items())
    except Exception as exc:  # a private helper of Triton's: only the header line depends on it
        return f"ptxas release unknown ({type(exc).__name__})"


def table(results: list[Built]) -> str:
    """Kernel by architecture: ``built`` / ``FAILED``, ``(gated)`` where the runtime does not launch it; then the
    gates' and the failures' first lines."""
    archs = sorted({r.arch for r in results})
    names = list(dict.fromkeys(r.name for r in results))
    cell = {(r.name, r.arch): ("built" if r.ok else "FAILED") + ("" if r.launched else " (gated)") for r in results}
    width = max(len(n) for n in names)
    lines = [f"{'kernel':<{width}}  " + "  ".join(f"{f'sm{a}':<14}" for a in archs)]
    lines += [f"{n:<{width}}  " + "  ".join(f"{cell[n, a]:<14}" for a in archs) for n in names]
    notes = {}
    for r in results:
        if not r.launched:
            notes.setdefault(f"gated: {r.gate}", set()).add(r.arch)
        if not r.ok:
            notes.setdefault(f"failed: {r.error}", set()).add(r.arch)
    lines += [f"  {', '.join(f'sm{a}' for a in sorted(a_s))}: {note}" for note, a_s in notes.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=triton_targets.ARCHS,
                        help="a compute capability to build for (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help=f"worker processes (default: one per CPU, at most {MAX_WORKERS})")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = build_all(tuple(args.arch or triton_targets.ARCHS), args.jobs)
    import triton
    print(f"[Sage Strided NHD] Triton {triton.__version__} ({_ptxas(args.arch or triton_targets.ARCHS)}): "
          f"{sum(r.ok for r in results)} of {len(results)} builds, {time.perf_counter() - start:.0f} s, no GPU")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
