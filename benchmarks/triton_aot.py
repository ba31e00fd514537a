"""The attention prototype compiled ahead of time: built for sm90 here, launched from its cubin there.

    python -m benchmarks.triton_aot --out DIR                   # every prototype config -> DIR
                                                                 # (the Gluon ws_* ones too, same ABI)
    python -m benchmarks.sage2_prototype --aot DIR ...           # on the GPU: time those cubins

Why: the prototype is written for the Triton a user installs with a current torch (3.8 here). A GPU
machine whose Python holds an older Triton (3.6 does not compile the ``_mmasum`` configs and
compiles the first cut at 22 instructions a score against 13) can still run the kernels the user
would get: Triton compiles them for sm90 on this machine without a GPU, and the GPU machine
loads the cubin through CuPy's module loader. The kernel's parameters are the Triton kernel's
non-constexpr arguments in order, then two scratch pointers Triton appends: global scratch (a
kernel that makes its own TMA descriptors keeps them there, ``global_scratch_size`` bytes per
program, allocated per launch as Triton's launcher does) and profile scratch (null). The manifest
records what a launch needs (the kernel's name, warps, dynamic shared memory, scratch, the parameter
count read from its PTX, the Triton that built it).

The compile is the one ``benchmarks/sm90_static`` reads: every pointer and the operands' padded
lengths divisible by 16 (as every launch has them), the sequence length left unspecialised, so one
cubin serves every length.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks import sage2_prototype as proto

# the prototype kernel's argument types; pointers and padded lengths are 16-divisible in every launch
SIGNATURE = dict(Q="*i8", QS="*fp32", K="*i8", KS="*fp32", V="*fp8e4nv", VS="*fp32", O="*bf16", S="i32", H="i32",
                 NQS="i32", NKS="i32", LPAD="i32", qk_scale="fp32")
DIVISIBLE_BY_16 = ("Q", "QS", "K", "KS", "V", "VS", "O", "NQS", "NKS", "LPAD")
SCRATCH_POINTERS = 2  # global and profile scratch, appended by Triton 3.x to every kernel's parameters
MANIFEST = "manifest.json"


def compile_sm90(config: proto.Config):
    """The prototype kernel compiled for sm90 with ``config`` (Triton's CompiledKernel)."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = list(proto._prototype_kernel.arg_names)
    signature = {n: SIGNATURE.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE_BY_16}
    source = triton.compiler.ASTSource(proto._prototype_kernel, signature=signature,
                                       constexprs=proto.kernel_constexprs(config, emulate=False), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=proto.compile_options(config))


def compile_named(name: str):
    """Config ``name`` compiled for sm90: a Triton prototype config or a warp-specialised Gluon one."""
    from benchmarks import sage2_ws

    if name in sage2_ws.WS_CONFIGS:
        return sage2_ws.compile_sm90(sage2_ws.WS_CONFIGS[name])
    return compile_sm90(proto.CONFIGS[name])


def ptx_parameter_count(ptx: str, kernel: str) -> int:
    """How many parameters the PTX entry ``kernel`` takes."""
    entry = re.search(r"\.entry\s+" + re.escape(kernel) + r"\s*\((.*?)\)", ptx, re.S)
    if not entry:
        raise ValueError(f"no .entry {kernel} in the PTX")
    return len(re.findall(r"\.param\s", entry[1]))


def build(out: Path, names: list[str]) -> dict:
    """Compile ``names`` into ``out`` (one cubin each) and write the manifest; returns it."""
    import triton

    out.mkdir(parents=True, exist_ok=True)
    arguments = [n for n in proto._prototype_kernel.arg_names if n in SIGNATURE]
    manifest = {"triton": triton.__version__, "target": "sm_90a", "arguments": arguments, "configs": {}}
    for name in names:
        kernel = compile_named(name)
        md = kernel.metadata
        params = ptx_parameter_count(kernel.asm["ptx"], md.name)
        if params != len(arguments) + SCRATCH_POINTERS:
            raise RuntimeError(f"{name}: the kernel takes {params} parameters, expected {len(arguments)} arguments + "
                               f"{SCRATCH_POINTERS} scratch pointers; this Triton's launch ABI is not the one assumed here")
        if md.profile_scratch_size:
            raise RuntimeError(f"{name}: the kernel asks for profile scratch, which this launcher does not allocate")
        (out / f"{name}.cubin").write_bytes(kernel.asm["cubin"])
        manifest["configs"][name] = {"kernel": md.name, "num_warps": md.num_warps, "shared": int(md.shared),
                                     "global_scratch_size": int(md.global_scratch_size),
                                     "global_scratch_align": int(md.global_scratch_align),
                                     "parameters": params, "cubin": f"{name}.cubin"}
        print(f"{name}: {md.num_warps} warps, {int(md.shared):,} B shared, {params} parameters", flush=True)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def kernel_arguments(values: tuple, arguments: list[str], global_scratch: int = 0) -> tuple:
    """The launch's parameter values, each as the fixed-width scalar the kernel reads: pointers (tensors)
    as 64-bit addresses, the ``i32`` arguments as int32, ``fp32`` as float32; then the global scratch
    address (0: none) and the null profile scratch."""
    import numpy as np

    if len(values) != len(arguments):
        raise ValueError(f"{len(values)} values for the {len(arguments)} arguments {arguments}")
    packed = []
    for name, value in zip(arguments, values):
        kind = SIGNATURE[name]
        if kind.startswith("*"):
            packed.append(np.uint64(value.data_ptr()))
        elif kind == "i32":
            if not -2**31 <= int(value) < 2**31:
                raise ValueError(f"{name} = {value} does not fit the kernel's int32 argument")
            packed.append(np.int32(value))
        else:
            packed.append(np.float32(value))
    return tuple(packed) + (np.uint64(global_scratch), np.uint64(0))


class Cubins:
    """The cubins of a ``build`` folder, loaded on this process's current CUDA device through CuPy."""

    def __init__(self, folder):
        import cupy

        self.folder = Path(folder)
        self.manifest = json.loads((self.folder / MANIFEST).read_text())
        self._cupy = cupy
        self._kernels = {}
        self._scratch = {}

    def __contains__(self, name: str) -> bool:
        return name in self.manifest["configs"]

    def _kernel(self, name: str):
        if name not in self._kernels:
            entry = self.manifest["configs"][name]
            module = self._cupy.RawModule(path=str(self.folder / entry["cubin"]))
            kernel = module.get_function(entry["kernel"])
            kernel.max_dynamic_shared_size_bytes = entry["shared"]
            self._kernels[name] = (module, kernel)
        return self._kernels[name][1]

    def launch(self, name: str, grid: tuple, values: tuple, stream_handle: int) -> None:
        """One launch of config ``name`` on the CUDA stream ``stream_handle`` (torch's current stream)."""
        if name not in self:
            raise KeyError(f"no cubin for config {name!r} in {self.folder} (built: {sorted(self.manifest['configs'])})")
        entry = self.manifest["configs"][name]
        kernel = self._kernel(name)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        scratch = self._global_scratch(entry, grid[0] * grid[1] * grid[2], values[0].device)
        args = kernel_arguments(values, self.manifest["arguments"], scratch)
        with self._cupy.cuda.ExternalStream(stream_handle):
            kernel(grid, (32 * entry["num_warps"], 1, 1), args, shared_mem=entry["shared"])

    def _global_scratch(self, entry: dict, programs: int, device) -> int:
        """The address of ``global_scratch_size`` bytes per program, aligned as the kernel asks (0: none).
        The buffer is kept for the next launch of the same size (the stream orders its reuse)."""
        import torch

        size, align = entry.get("global_scratch_size", 0), entry.get("global_scratch_align", 1)
        if not size:
            return 0
        key = (str(device), programs * size, align)
        if key not in self._scratch:
            self._scratch[key] = torch.empty(programs * size + align, dtype=torch.uint8, device=device)
        base = self._scratch[key].data_ptr()
        return -(-base // align) * align


def check_compilable(tool: str, names: list[str]) -> None:
    """SystemExit naming the problem when ``names`` holds an unknown config or Triton is missing."""
    known = proto.all_configs()
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"{tool}: unknown configs {unknown}; known: {sorted(known)}")
    if proto.triton is None:
        raise SystemExit(f"{tool}: needs Triton ({proto.sq.TRITON_ERROR})")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the cubins and manifest.json")
    p.add_argument("--configs", nargs="+", default=list(proto.all_configs()))
    args = p.parse_args(argv)
    check_compilable("triton_aot", args.configs)
    return build(args.out, args.configs)


if __name__ == "__main__":
    main()
