"""The Triton kernels the runtime launches on a GPU, each with the specialisations it launches them with at H3's
geometry: argument types, constexprs and warps, from the runtime's own constants. ``devkit.triton_aot`` compiles
them for ``ARCHS``; tests/unit/test_triton_aot.py checks this list against the runtime's launch sites and against
the launches a small interpreted run of each pass makes.

On a GPU the interpreter-only flags have their GPU values (``GPU_FLAGS``): ``interpreting()`` is false there and
``hardware_bf16`` holds from ``HW_BF16_MIN_CAPABILITY``. ``gate`` asks the runtime's own capability checks whether
it launches a kernel on an architecture, and why not. Integer arguments are declared i32, as launched (the JIT also
folds an argument that happens to be 1 into a constant: the same code with one value known)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch

from .h3 import FULL_H3
from .pack import submodule

ARCHS = (80, 89, 90, 100, 120, 121)  # compute capabilities, as Triton's GPUTarget names them (sm80 ... sm121)
ROPE_AXES = 3  # H3 rotates (t, h, w) pairs, FULL_H3["rope_inv_freq_len"] frequencies each


@dataclass(frozen=True)
class Launch:
    """One specialisation of a kernel: what the JIT compiles for one kind of launch."""

    module: str        # the kernels submodule defining it
    kernel: str        # the @triton.jit function's name
    signature: tuple   # ((argument, Triton type), ...): the runtime arguments, in order
    constexprs: tuple  # ((name, value), ...): the constexpr arguments, in order
    num_warps: int
    label: str = ""    # what launches it (not part of the comparison)
    num_stages: int | None = None  # the software pipeline's depth where the launch sets it (else Triton's default)

    @property
    def key(self) -> tuple:
        return self.module, self.kernel, self.signature, self.constexprs, self.num_warps, self.num_stages

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.label}]" if self.label else self.kernel


def _types(names: str, kind: str) -> list[tuple[str, str]]:
    return [(n, kind) for n in names.split()]


def _hw_bf16(cc: int) -> bool:
    return divmod(cc, 10) >= submodule("kernels.triton_support").HW_BF16_MIN_CAPABILITY


# constexprs whose value differs between the interpreter and a GPU -> their value on a GPU of compute capability cc
GPU_FLAGS = {"EMULATE": lambda cc: False, "EMULATE_FP8": lambda cc: False, "HW_BF16": _hw_bf16}


def _flag(name: str, cc: int) -> tuple[str, bool]:
    return name, GPU_FLAGS[name](cc)


def int8_quantiser_launches(cc: int) -> list[Launch]:
    """``quantize_rows`` at H3's linear widths: qkv / fc1 input (plain or with the modulation folded), out_proj
    input (heads x head_dim) and fc2 input (SwiGLU of fc1's halves)."""
    mod = submodule("kernels.int8_activation")
    hidden, ffn = FULL_H3["hidden_size"], FULL_H3["ffn_hidden_size"]
    inner = FULL_H3["num_attention_heads"] * FULL_H3["attention_head_dim"]
    sig = tuple(_types("X S1 B", "*bf16") + [("Q", "*i8"), ("SCALE", "*fp32")]
                + _types("K stride_x stride_p stride_q", "i32") + _types("inv_127 bf16_max", "fp32"))
    out = []
    for width, act, modulated, label in ((hidden, None, False, "qkv/fc1"), (hidden, None, True, "qkv/fc1 modulated"),
                                         (inner, None, False, "out_proj"), (ffn, "swiglu", False, "fc2 swiglu")):
        g1, g2, g3 = mod.row_tiles(width // mod.GROUP)
        consts = (("SWIGLU", act == "swiglu"), ("MOD", modulated), ("G1", g1), ("G2", g2), ("G3", g3),
                  _flag("EMULATE", cc))
        out.append(Launch("int8_activation", "_quantize_rows_kernel", sig, consts, mod.row_warps(width), label))
    return out


def norm_rope_launches(cc: int) -> list[Launch]:
    """``norm_rope_pass`` at H3's head_dim and rotated prefix, with a bf16 rope table (ComfyUI's H3 makes it in the
    model's dtype) or an fp32 one (``own_pass_takes`` admits both)."""
    mod = submodule("kernels.qk_transform")
    d = FULL_H3["attention_head_dim"]
    p = ROPE_AXES * FULL_H3["rope_inv_freq_len"]
    tail = d - 2 * p
    consts = (("D", d), ("P", p), ("PP", _next_pow2(max(p, 1))), ("TAIL", tail), ("TP", _next_pow2(max(tail, 1))),
              ("R", mod.NORM_ROPE_TOKENS), ("HG", mod.NORM_ROPE_HEADS), _flag("EMULATE", cc), _flag("HW_BF16", cc))
    out = []
    for table in ("*bf16", "*fp32"):
        sig = tuple(_types("Q K", "*bf16") + [("T", table)] + _types("QW KW", "*bf16")
                    + _types("S H sqs sqh sks skh sts stp str_ stc", "i32") + [("eps", "fp32")])
        out.append(Launch("qk_transform", "_norm_rope_kernel", sig, consts, mod.NORM_ROPE_WARPS,
                          f"{table[1:]} rope table"))
    return out


def sage2_prep_launches(cc: int) -> list[Launch]:
    """The sage2 prepared path's passes: the V absmax, the finalisation, and the quantisation per mode, whole
    (``quantize_operands``) or Q by token chunks, then K, then V (``RowOperands``); an operand a launch does not
    touch is handed one the launch uses in its place (``_quant_launch``)."""
    mod = submodule("kernels.sage2_quant")
    d = mod.HEAD_DIM
    out = [
        Launch("sage2_quant", "_vmax_kernel", (("V", "*bf16"), ("VMAX", "*fp32"), *_types("S HD svs svh", "i32")),
               (("D", d), ("ROWS", mod.VMAX_ROWS), ("RB", mod.VMAX_TILE_ROWS), ("BC", mod.VMAX_COLS)),
               mod.VMAX_WARPS),
        Launch("sage2_quant", "_finalize_kernel",
               (*_types("VMAX VSCALE VRECP", "*fp32"), *_types("VSPLIT H", "i32"), ("scale_max", "fp32")),
               (("D", d),), 1),
    ]
    for mode, rotate in mod.MODES.items():
        for do_q, do_k, do_v, label in ((True, True, True, "whole"), (True, False, False, "Q rows"),
                                        (False, True, False, "K"), (False, False, True, "V")):
            # an input a launch does not read is the launch's first input; an output it does not write its first
            given = "*bf16"
            written = "*i8" if do_q or do_k else "*fp8e4nv"
            sig = ((("Q", given), ("K", given), ("V", given)) + tuple(_types("KM VR", "*fp32"))
                   + (("QO", "*i8" if do_q else written), ("QS", "*fp32"), ("KO", "*i8" if do_k else written),
                      ("KS", "*fp32"), ("VO", "*fp8e4nv" if do_v else written))
                   + tuple(_types("S SQ ROW0 H NQB NKB LPAD sqs sqh sks skh svs svh", "i32")))
            consts = (("D", d), ("ROTATE", rotate), _flag("EMULATE_FP8", cc), ("DO_Q", do_q), ("DO_K", do_k),
                      ("DO_V", do_v))
            out.append(Launch("sage2_quant", "_quant_kernel", sig, consts, mod.QUANT_WARPS[rotate],
                              f"{mode} {label}"))
    return out


def block_pass_launches(cc: int) -> list[Launch]:
    """The block fast path's elementwise passes: modulation and gated residual (one parameter row, or one per
    token), and the exact SwiGLU; every operand bf16 (the block hands parameters in the rows' dtype)."""
    mod = submodule("kernels.h3_block")
    tile = (("BLOCK_R", mod.BLOCK_ROWS), ("BLOCK_C", mod.BLOCK_COLS))
    hw = _flag("HW_BF16", cc)
    out = []
    for per_row in (False, True):
        label = "per-token rows" if per_row else "one row"
        out.append(Launch("h3_block", "_scale_shift_kernel",
                          tuple(_types("h_ptr scale_ptr shift_ptr", "*bf16") + _types("rows cols stride_row", "i32")),
                          (("PER_ROW", per_row), hw, *tile), 4, label))
        out.append(Launch("h3_block", "_gated_residual_kernel",
                          tuple(_types("x_ptr y_ptr gate_ptr", "*bf16") + _types("rows cols stride_x stride_y", "i32")),
                          (("PER_ROW", per_row), hw, *tile), 4, label))
    out.append(Launch("h3_block", "_swiglu_exact_kernel",
                      tuple(_types("u_ptr y_ptr", "*bf16") + _types("rows half stride_u stride_y", "i32")),
                      (_flag("EMULATE", cc), hw, *tile), 4))
    return out


def _gemm_tiling(cc: int):
    """The int8 GEMM's tiling on ``cc``: its declared one, or (where the runtime does not launch it) the first one
    declared, to show whether it builds there."""
    mod = submodule("kernels.int8_gemm")
    return mod.CONFIGS.get(divmod(cc, 10), next(iter(mod.CONFIGS.values())))


def _gemm_launch(cc: int, bias: bool, per_column: bool = False, gated: bool = False) -> Launch:
    cfg = _gemm_tiling(cc)
    sig = ((("a_desc", f"tensordesc<i8[{cfg.block_m}, {cfg.block_k}]>"),
            ("b_desc", f"tensordesc<i8[{cfg.block_n}, {cfg.block_k}]>"), ("out_ptr", "*bf16"))
           + tuple(_types("x_scale_ptr w_scale_ptr", "*fp32")) + (("bias_ptr", "*bf16" if bias else "*fp32"),)
           + (("gate_ptr", "*bf16" if gated else "*fp32"),) + tuple(_types("M N K stride_out NUM_PROGRAMS", "i32")))
    consts = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k), ("GROUP_M", cfg.group_m),
              ("SCALE_PER_COLUMN", per_column), ("HAS_BIAS", bias), ("GATED", gated), _flag("EMULATE", cc))
    label = ("with a bias" if bias else "no bias") + (", a gated residual" if gated else "")
    return Launch("int8_gemm", "_int8_gemm_kernel", sig, consts, cfg.warps, label, cfg.stages)


def int8_gemm_launches(cc: int) -> list[Launch]:
    """The int8 route's GEMM (tensor-wise weight scale), with and without a bias, and adding out_proj's / fc2's
    gated residual."""
    return [_gemm_launch(cc, bias, gated=gated) for bias, gated in ((False, False), (True, False), (False, True))]


# the runtime's Triton passes: each gives its launches on an architecture
PASSES = (int8_quantiser_launches, norm_rope_launches, sage2_prep_launches, block_pass_launches, int8_gemm_launches)


def declared(cc: int) -> list[Launch]:
    """Every declared launch on ``cc``, whether or not the runtime launches it there (see ``gate``)."""
    return [launch for make in PASSES for launch in make(cc)]


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def full_signature(fn, launch: Launch) -> dict[str, str]:
    """``launch``'s signature in ``fn``'s argument order, constexprs marked: ``ASTSource``'s form. Raises where the
    declaration and the kernel's parameters differ."""
    types = dict(launch.signature) | {name: "constexpr" for name, _ in launch.constexprs}
    if sorted(types) != sorted(fn.arg_names) or len(types) != len(launch.signature) + len(launch.constexprs):
        raise ValueError(f"{launch.name} declares {sorted(types)}, the kernel takes {sorted(fn.arg_names)}")
    return {name: types[name] for name in fn.arg_names}


@dataclass(frozen=True)
class Gate:
    """Why the runtime does not launch a kernel on an architecture; ``build``: a declared build capability."""

    reason: str
    build: bool = False


def _sage2_prepared_gate(arch: int) -> Gate | None:
    """The prepared path's own architecture check, asked for ``arch`` (CPU tensors: a check past it says so)."""
    sage2 = submodule("kernels.backends.sage2")
    q = torch.zeros(1, 1, 1, submodule("kernels.sage2_quant").HEAD_DIM, dtype=torch.bfloat16)
    with mock.patch.object(submodule("kernels.gpu"), "capability", lambda device: divmod(arch, 10)):
        verdict = sage2.Sage2Backend().prepared_verdict(q, q, q)
    return Gate(verdict.reason) if not verdict.ok and verdict.code == "gpu_arch" else None


def _int8_gemm_gate(arch: int) -> Gate | None:
    """The GEMM's own answer for a GPU of ``arch`` (a stand-in device, no answers recorded yet: none is asked)."""
    gemm, gpu = submodule("kernels.int8_gemm"), submodule("kernels.gpu")
    with (mock.patch.object(gpu, "capability", lambda device: divmod(arch, 10)),
          mock.patch.object(gpu, "ANSWERS", gpu.DeviceAnswers()), mock.patch.object(gemm, "interpreting", lambda: False)):
        why = gemm.gemm_problem(torch.device("cuda", 0), gemm.K_ALIGN)
    return Gate(why) if why else None


GATES = {  # kernels module -> the runtime's architecture gate of the pass it holds (None: launched there)
    "sage2_quant": _sage2_prepared_gate,
    "int8_gemm": _int8_gemm_gate,
}


def gate(launch: Launch, arch: int) -> Gate | None:
    """Why the runtime would not launch ``launch`` on ``arch`` (None: it would, where its call is taken)."""
    ask = GATES.get(launch.module)
    return ask(arch) if ask else None


# --- what the runtime launches, to compare the declaration with -------------------------------------------------


def jit_kernels() -> dict[tuple[str, str], object]:
    """Every Triton function the kernels package defines, by (module, name); a module path below ``kernels``. Gluon
    kernels are not among them: their launchers fix layouts and descriptors this table does not model, and
    devkit/gluon_aot.py builds them (tests/unit/test_int8_gemm_sm90.py)."""
    package = submodule("kernels")
    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            gluon = callable(getattr(value, "is_gluon", None)) and value.is_gluon()
            if (callable(getattr(value, "run", None)) and inspect.isfunction(fn) and fn.__module__ == module.__name__
                    and not gluon):
                found[info.name[len(package.__name__) + 1:], name] = value
    return found


def launch_sites() -> set[tuple[str, str]]:
    """The (module, name) of every kernel launched (``name[grid](...)``) in the runtime's source (kernels/, nodes/)."""
    root = Path(submodule("kernels").__path__[0]).parent
    source = "\n".join(p.read_text() for d in ("kernels", "nodes") for p in sorted((root / d).rglob("*.py")))
    return {key for key in jit_kernels() if re.search(rf"\b{key[1]}\[", source)}  # a device call is name(...)


def _recorder(module: str, kernel, launches: list):
    """``kernel.run`` that first appends the launch to ``launches``: argument types as the JIT names them."""
    signature = inspect.signature(kernel.fn)
    params = signature.parameters
    constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    run = kernel.run

    def recording_run(*args, grid, warmup, **kwargs):
        from triton.runtime.jit import mangle_type

        values = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params}).arguments
        launches.append(Launch(module, kernel.fn.__name__,
                               tuple((n, mangle_type(values[n])) for n in params if n not in constexpr),
                               tuple((n, values[n]) for n in params if n in constexpr), kwargs.get("num_warps", 4),
                               num_stages=kwargs.get("num_stages")))
        return run(*args, grid=grid, warmup=warmup, **kwargs)
    return recording_run


@contextlib.contextmanager
def recorded_launches():
    """Within: every launch of a kernel of the kernels package appended to the yielded list, as launched (under the
    interpreter, the interpreter's flags: ``on_gpu`` gives the same launch on a GPU). ``num_warps``: 4 unless given,
    Triton's default."""
    launches: list[Launch] = []
    kernels = jit_kernels()
    try:
        for (module, _), kernel in kernels.items():
            kernel.run = _recorder(module, kernel, launches)
        yield launches
    finally:
        for kernel in kernels.values():
            vars(kernel).pop("run", None)


def on_gpu(launch: Launch, cc: int) -> Launch:
    """``launch`` as the same call makes it on a GPU of compute capability ``cc`` (``GPU_FLAGS``; the int8 GEMM
    takes its GPU tiling, not the interpreter's small one)."""
    consts = tuple((n, GPU_FLAGS[n](cc) if n in GPU_FLAGS else v) for n, v in launch.constexprs)
    if launch.kernel == "_int8_gemm_kernel":
        flags = dict(consts)
        return _gemm_launch(cc, flags["HAS_BIAS"], flags["SCALE_PER_COLUMN"], flags["GATED"])
    return replace(launch, constexprs=consts)
