"""The block path's memory-bound passes one by one on an H100/H200, at H3's shapes.

    python -m benchmarks.prep_passes --seq 8192 37810 --reps 15 --out prep-passes.json

Attention preparation (``--part attention``):

Strided NHD views [1, S, 56, 128] of one fused bf16 buffer [S, 3*7168]. Each pass is timed with
CUDA events, every variant interleaved rep by rep (each leads in turn), median of ``--reps``, and
its bytes moved are set beside it as a bandwidth:

  copy_qk            -- ``torch`` copy of a [S, 2*7168] buffer: the device's copy bandwidth here
  norm_rope <tiling> -- the in-place RMSNorm+RoPE pass for each tiling of ``--norm-rope``
  k_mean, v_absmax   -- the exact reduction's two reads (SageAttention's ``k.mean`` and the V pass)
  v_absmax <tiling>  -- the V pass for each tiling of ``--vmax`` (rows a program, rows a tile,
                        channels a program, warps)
  reduce_exact       -- both, with the finalisation: ``sage2_quant._reduce_impl`` as exact mode runs it
  quantize           -- the quantisation pass (Q, K, V -> int8 / fp8 operands)
  kernel_out_<nhd|hnd> -- SageAttention's sm90 kernel on the prepared operands, its output token-major
                        (what the pack writes) or head-major (what ``sageattn(..., "HND")`` writes)
  kernel_after_<idle|kernel> -- the token-major call again, enqueued behind ``--idle-ms`` of a one-thread
                        busy wait (the device nearly idle) or behind an untimed call of the same kernel:
                        whether the kernel's own time depends on what the GPU ran just before it (its
                        clock under the power limit)

Every norm_rope tiling must give the default tiling's bits, and both outputs of the kernel the
same values; the run says so.

The block's own passes (``--part block``), on [S, 5376] rows (SwiGLU on fc1's [S, 28672] output),
one modulation row for all:

  rms_norm, addcmul       -- stock's torch calls (the norm, the gated residual)
  scale_shift, residual   -- the exact path's modulation and gated residual passes
  norm_modulate <tiling>, residual_norm_modulate <tiling> -- fused mode's passes per ``--norm-modulate``
                        tiling: WARPS (one row a program) or ROWS,COLS,WARPS (two sweeps over rows)
  swiglu_exact, swiglu_fused -- SwiGLU with stock's two roundings / one

with each fused tiling's largest difference from the default's output.

Passes that round to bf16 (norm_rope, scale_shift, residual, the two SwiGLUs) are also timed with
``round_bf16``'s integer form (``<name> (integer rounding)``): the same bits as the conversion
instruction a GPU of compute capability 8.0 or later now takes, which the run checks
(``rounding_forms_agree``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.measure import event_timed, interleaved_times, summary
from devkit.inputs import fused_attention_inputs
from devkit.pack import kernels as _kernels
from devkit.pack import submodule

kernels = _kernels()
sage2_quant = submodule("kernels.sage2_quant")
qk_transform = submodule("kernels.qk_transform")
h3_block = submodule("kernels.h3_block")
h3_block_fused = submodule("kernels.h3_block_fused")

HEADS, D, ROT, EPS = 56, 128, 96, 1e-5
HIDDEN, FFN = 5376, 14336  # H3's block width and MLP width (fc1 gives 2 * FFN)
SLEEP_CYCLES_PER_MS = 1.98e6  # torch.cuda._sleep counts SM cycles; about a millisecond at sm90's top clock
# RMSNorm + RoPE tilings: the default compiles for sm90 to 124 registers a thread, which leaves room for
# 16 warps an SM (4 programs of 4), as 4,8,1,0 at 121 (16 programs of 1); the others differ in bytes in
# flight per program (smaller programs, or Q and K read before either is stored)
TILINGS = ("16,8,4,0", "16,8,4,1", "8,8,4,1", "8,8,2,1", "4,8,1,1", "4,8,1,0", "8,16,2,1")
VMAX_TILINGS = ("256,8,1024,4", "256,16,1024,8", "256,8,1024,8", "512,32,512,8", "128,8,1024,4", "256,4,2048,4")


# the modules whose passes round to bf16 with ``round_bf16``; ``integer_rounding`` sets their form
ROUNDING_MODULES = (qk_transform, h3_block, h3_block_fused)
INTEGER = " (integer rounding)"  # suffix of a pass timed with round_bf16's integer form


def integer_rounding(fn):
    """``fn`` with every pass rounding to bf16 in integer operations (``round_bf16``'s form without the
    conversion instruction): the same bits, more instructions."""
    def run():
        saved = [m.hardware_bf16 for m in ROUNDING_MODULES]
        for m in ROUNDING_MODULES:
            m.hardware_bf16 = lambda device: False
        try:
            return fn()
        finally:
            for m, f in zip(ROUNDING_MODULES, saved):
                m.hardware_bf16 = f
    return run


def forms_agree(fn) -> bool:
    """``fn()`` (a fresh output each call) gives the same bits with round_bf16's two forms."""
    return bool(torch.equal(fn(), integer_rounding(fn)()))


def tiling(text: str) -> tuple:
    tokens, heads, warps, qk_first = (int(x) for x in text.split(","))
    return tokens, heads, warps, bool(qk_first)


def norm_roped(qkv, table, qw, kw, config=None):
    """A copy of the fused buffer after one RMSNorm+RoPE pass on its Q and K (``config``: the tiling)."""
    buf = qkv.clone()
    q, k, _ = buf.unflatten(1, (3, HEADS, D)).unsqueeze(0).unbind(2)
    qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS, config=config)
    return buf


def norm_rope_bits_agree(qkv, table, qw, kw, tilings) -> dict:
    """Each tiling's Q/K after one pass, against the default tiling's: elements that differ."""
    want = norm_roped(qkv, table, qw, kw, qk_transform.NORM_ROPE_CONFIG)
    return {",".join(str(int(x)) for x in t): int((norm_roped(qkv, table, qw, kw, t) != want).sum()) for t in tilings}


def passes(seq: int, reps: int, warmup: int, tilings, vmax_tilings=(), idle_ms: float = 0.0) -> dict:
    qkv, table, qw, kw = fused_attention_inputs(seq, HEADS, D, ROT, seed=seq, weight_mean=1.0,
                                                weight_spread=0.2, table_dtype=torch.bfloat16)
    q, k, v = qkv.unflatten(1, (3, HEADS, D)).unsqueeze(0).unbind(2)
    element = seq * HEADS * D  # one of Q, K, V
    mib = 2 * element  # bf16 bytes of one of them
    scratch = torch.empty(seq, 2 * HEADS * D, dtype=torch.bfloat16, device=qkv.device)
    source = qkv[:, :2 * HEADS * D].contiguous()
    kmean, vscale, vrecp = sage2_quant._reduce_impl(k, v, None, None, 0.0, False)
    operands = sage2_quant.quantize_operands(q, k, v, mode="exact")
    prepared = kernels.BACKENDS["sage2"].prepare(q, k, v, mode="exact")
    out_hnd = torch.empty(1, HEADS, seq, D, dtype=torch.bfloat16, device=qkv.device)

    def v_absmax(*tiling):
        return sage2_quant.v_absmax_partials(v, *tiling).amax(0)

    def kernel_to(out):
        op, reason = kernels.backends.sage2._sm90_attention_op()
        if op is None:
            raise RuntimeError(reason)
        p = prepared.operands
        op(p["q_int8"].permute(1, 0, 2).unsqueeze(0), p["k_int8"].permute(1, 0, 2).unsqueeze(0),
           p["v_fp8"].permute(1, 0, 2).unsqueeze(0), out, p["q_scale"], p["k_scale"], p["v_scale"],
           0, 0, 3, prepared.sm_scale, 0)

    fns = {"copy_qk": (lambda: scratch.copy_(source), 4 * mib)}
    for t in tilings:
        name = "norm_rope " + ",".join(str(int(x)) for x in t)
        fns[name] = ((lambda t=t: qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS, config=t)), 4 * mib)
    fns["norm_rope" + INTEGER] = (integer_rounding(lambda: qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS)), 4 * mib)
    fns.update({
        "k_mean": (lambda: k.mean(dim=1, keepdim=True), mib),
        "v_absmax": (v_absmax, mib),
        **{"v_absmax " + t: ((lambda t=t: v_absmax(*(int(x) for x in t.split(",")))), mib) for t in vmax_tilings},
        "reduce_exact": (lambda: sage2_quant._reduce_impl(k, v, None, None, 0.0, False), 2 * mib),
        "quantize": (lambda: sage2_quant._quantize_impl(q, k, v, kmean, vrecp, None, None, None, 0.0, False, False),
                     3 * mib + 3 * element),
    })
    has_kernel = kernels.backends.sage2._sm90_attention_op()[0] is not None
    if has_kernel:
        out_nhd = torch.empty(1, seq, HEADS, D, dtype=torch.bfloat16, device=qkv.device)
        fns["kernel_out_nhd"] = (lambda: kernel_to(out_nhd), None)
        fns["kernel_out_hnd"] = (lambda: kernel_to(out_hnd.transpose(1, 2)), None)
    runners = {n: event_timed(f) for n, (f, _) in fns.items()}
    if has_kernel and idle_ms:
        cycles = int(idle_ms * SLEEP_CYCLES_PER_MS)
        to_nhd, to_hnd = fns["kernel_out_nhd"][0], fns["kernel_out_hnd"][0]
        runners["kernel_after_idle"] = event_timed(to_nhd, before=lambda: torch.cuda._sleep(cycles))
        runners["kernel_after_kernel"] = event_timed(to_nhd, before=to_hnd)
    times = interleaved_times(runners, reps, warmup)
    rows = {}
    for name in runners:
        nbytes = fns[name][1] if name in fns else None  # the kernel_after rows move no counted bytes
        p50 = summary(times[name])["p50_seconds"]
        rows[name] = {"p50_ms": p50 * 1e3, "spread": summary(times[name])["spread"],
                      "gb_per_s": nbytes / p50 / 1e9 if nbytes else None}
    result = {"seq": seq, "reps": reps, "passes": rows,
              "norm_rope_elements_differing_from_default": norm_rope_bits_agree(qkv, table, qw, kw, tilings),
              "rounding_forms_agree": {"norm_rope": forms_agree(lambda: norm_roped(qkv, table, qw, kw))},
              "v_absmax_tilings_equal": all(torch.equal(v_absmax(*(int(x) for x in t.split(","))), v_absmax())
                                            for t in vmax_tilings)}
    if has_kernel:
        kernel_to(out_nhd)
        kernel_to(out_hnd.transpose(1, 2))
        result["kernel_outputs_equal"] = bool(torch.equal(out_nhd, out_hnd.transpose(1, 2)))
    return result


NORM_MODULATE_TILINGS = ("16", "8", "4", "4,1024,4", "8,1024,8", "2,2048,4", "4,512,4")


def norm_modulate_tiling(text: str):
    parts = tuple(int(x) for x in text.split(","))
    return parts[0] if len(parts) == 1 else parts


def block_passes(seq: int, reps: int, warmup: int, tilings, device="cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(seq)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    x, other, h = rand(seq, HIDDEN), rand(seq, HIDDEN), rand(seq, HIDDEN)
    w, scale1, shift, gate = rand(HIDDEN), 1 + rand(HIDDEN), rand(HIDDEN), rand(HIDDEN)
    u = rand(seq, 2 * FFN)
    row = 2 * seq * HIDDEN  # bf16 bytes of one [S, 5376] tensor
    fns = {
        "rms_norm": (lambda: torch.nn.functional.rms_norm(x, (HIDDEN,), w, 1e-6), 2 * row),
        "scale_shift": (lambda: h3_block.scale_shift_(h, scale1, shift), 2 * row),
        "addcmul": (lambda: x.addcmul_(other, gate), 3 * row),
        "residual": (lambda: h3_block.gated_residual_(x, other, gate), 3 * row),
        "swiglu_exact": (lambda: h3_block.swiglu(u), 3 * seq * FFN * 2),
        "swiglu_fused": (lambda: h3_block_fused.swiglu(u), 3 * seq * FFN * 2),
    }
    for name in ("scale_shift", "residual", "swiglu_exact", "swiglu_fused"):
        fns[name + INTEGER] = (integer_rounding(fns[name][0]), fns[name][1])
    for t in tilings:
        tiling = norm_modulate_tiling(t)
        fns[f"norm_modulate {t}"] = ((lambda tiling=tiling: h3_block_fused._norm_modulate_impl(
            x, None, None, w, scale1, shift, 1e-6, h, tiling=tiling)), 2 * row)
        fns[f"residual_norm_modulate {t}"] = ((lambda tiling=tiling: h3_block_fused._norm_modulate_impl(
            x, other, gate, w, scale1, shift, 1e-6, h, tiling=tiling)), 4 * row)
    times = interleaved_times({n: event_timed(f) for n, (f, _) in fns.items()}, reps, warmup)
    rows = {}
    for name, (_, nbytes) in fns.items():
        p50 = summary(times[name])["p50_seconds"]
        rows[name] = {"p50_ms": p50 * 1e3, "spread": summary(times[name])["spread"], "gb_per_s": nbytes / p50 / 1e9}

    def normed(tiling):
        out = torch.empty_like(x)
        h3_block_fused._norm_modulate_impl(x, None, None, w, scale1, shift, 1e-6, out, tiling=tiling)
        return out
    default = normed("default")
    differs = {t: float((normed(norm_modulate_tiling(t)).float() - default.float()).abs().max()) for t in tilings}
    fresh = {  # each pass on fresh copies of its inputs
        "scale_shift": lambda: h3_block.scale_shift_(h.clone(), scale1, shift),
        "residual": lambda: h3_block.gated_residual_(x.clone(), other, gate),
        "swiglu_exact": lambda: h3_block.swiglu(u),
        "swiglu_fused": lambda: h3_block_fused.swiglu(u),
        "norm_modulate": lambda: normed("default"),
    }
    return {"seq": seq, "reps": reps, "passes": rows, "norm_modulate_max_abs_from_default": differs,
            "rounding_forms_agree": {name: forms_agree(fn) for name, fn in fresh.items()}}


def print_result(r: dict) -> None:
    print(f"\nS = {r['seq']}, {r['reps']} reps, p50")
    print("| pass | ms | GB/s | spread |")
    print("|---|---|---|---|")
    for name, row in r["passes"].items():
        bw = f"{row['gb_per_s']:.0f}" if row["gb_per_s"] else "-"
        print(f"| {name} | {row['p50_ms']:.3f} | {bw} | {row['spread']:.1%} |")
    print(f"round_bf16's two forms give the same bits: {r['rounding_forms_agree']}")
    if "norm_modulate_max_abs_from_default" in r:
        print(f"norm_modulate, largest difference from the default tiling: {r['norm_modulate_max_abs_from_default']}")
        return
    print(f"norm_rope elements differing from the default tiling: {r['norm_rope_elements_differing_from_default']}")
    print(f"every V absmax tiling gives the same maxima: {r['v_absmax_tilings_equal']}")
    if "kernel_outputs_equal" in r:
        print(f"kernel outputs token-major and head-major equal: {r['kernel_outputs_equal']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--norm-rope", nargs="+", default=list(TILINGS), metavar="TOKENS,HEADS,WARPS,QK_FIRST",
                   help="tilings of the RMSNorm+RoPE pass to time")
    p.add_argument("--vmax", nargs="*", default=list(VMAX_TILINGS), metavar="ROWS,TILE_ROWS,COLS,WARPS",
                   help="tilings of the V absmax pass to time")
    p.add_argument("--part", choices=("attention", "block", "both"), default="both")
    p.add_argument("--idle-ms", type=float, default=20.0,
                   help="the near-idle wait ahead of kernel_after_idle (0: leave both kernel_after rows out)")
    p.add_argument("--norm-modulate", nargs="+", default=list(NORM_MODULATE_TILINGS), metavar="WARPS|ROWS,COLS,WARPS",
                   help="tilings of fused mode's norm + modulation pass to time")
    p.add_argument("--out", help="results JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    tilings = [tiling(t) for t in args.norm_rope]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for seq in args.seq:
        if args.part in ("attention", "both"):
            results["runs"].append(passes(seq, args.reps, args.warmup, tilings, args.vmax, args.idle_ms))
            print_result(results["runs"][-1])
        if args.part in ("block", "both"):
            results["runs"].append(block_passes(seq, args.reps, args.warmup, args.norm_modulate))
            print_result(results["runs"][-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
