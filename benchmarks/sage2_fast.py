"""The sage2 sm90 fast path on an H100/H200: speed (issue 9) and int8 accuracy with outliers (issue 13).

    python -m benchmarks.sage2_fast --out h200-sage2-fast.json                 # both parts
    python -m benchmarks.sage2_fast --part speed --seq 8192 37810 --reps 15

Speed: strided NHD views [1, S, 56, 128] of one fused bf16 buffer [S, 3*7168] (already normed +
roped for the exact and rotated modes; fused modes are timed on the same buffer with their own
norm+rope inside). Variants run interleaved rep by rep (each leads in turn), CUDA events around
each call, median of ``--reps``:
  sageattn            -- stock ``sageattn(q, k, v, tensor_layout="NHD")``, its own preparation inside
  kernel_alone        -- ``attend()`` on operands prepared once (SageAttention's sm90 kernel only)
  fast_<mode>         -- ``prepare()`` + ``attend()`` for exact / rotated / fused / fused_rotated
  prepare_<mode>      -- ``prepare()`` alone
Peak extra memory of one call each, and whether exact mode equals sageattn bit for bit.

Accuracy: random Q/K/V at the H3 head shape, then Q/K with their energy concentrated in k of 128
channels (k = 1, 2, 4, 8; the chosen channels 10x or 100x the rest, the whole vector rescaled to
its original norm) and/or a per-channel mean offset on K; relative L2 error of the output against
fp32 attention on the first and last 256 query rows, for sageattn as is, the rotated mode, SDPA
in bf16 and comfy-kitchen int8_attention when importable.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.measure import interleaved_times, peak_extra_bytes, summary
from devkit.inputs import fused_attention_inputs
from devkit.pack import kernels as _kernels

kernels = _kernels()
from comfyui_sage_strided_nhd.kernels import sage2_quant, sage2_quant_ref  # noqa: E402

BACKEND = kernels.BACKENDS["sage2"]
HEADS, D, ROT, EPS = 56, 128, 96, 1e-5
MODES = ("exact", "rotated", "fused", "fused_rotated")


def make_buffer(seq, seed, heads=HEADS):
    return fused_attention_inputs(seq, heads, D, ROT, seed=seed, weight_mean=1.0, weight_spread=0.2,
                                  table_dtype=torch.float32)


def views(qkv, heads=HEADS):
    return qkv.unflatten(1, (3, heads, D)).unsqueeze(0).unbind(2)


def event_timed(fn):
    def run():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return run


def pick_v_div_mode(q, k, v):
    """Which division reproduces SageAttention's fp8 V scales (its CUDA is built --use_fast_math)."""
    from sageattention.quant import per_channel_fp8
    pad = (128 - v.shape[1] % 128) % 128
    vp = torch.cat([v, torch.zeros(1, pad, v.shape[2], D, dtype=v.dtype, device=v.device)], 1) if pad else v
    vf, vs, _ = per_channel_fp8(vp, tensor_layout="NHD", smooth_v=False)
    counts = {}
    for mode in (0, 1, 2):
        ops = sage2_quant.quantize_operands(q, k, v, div_mode=mode)
        counts[mode] = int((ops["v_fp8"].view(torch.uint8) != vf[0].permute(1, 0, 2).view(torch.uint8)).sum()
                           + (ops["v_scale"] != vs).sum())
    best = min(counts, key=counts.get)
    return best, counts


def speed(seq, reps, warmup):
    from sageattention import sageattn
    qkv, table, qw, kw = make_buffer(seq, 7)
    q, k, v = views(qkv)
    sage2_quant_ref.norm_rope_eager_(q, k, table, qw, kw, EPS)
    div_mode, div_counts = pick_v_div_mode(q, k, v)
    sage2_quant.V_DIV_MODE = div_mode
    fused_kw = dict(rope_table=table, q_weight=qw, k_weight=kw, eps=EPS)
    prepared = BACKEND.prepare(q, k, v, mode="exact")

    def prep(mode):
        return BACKEND.prepare(q, k, v, mode=mode, **(fused_kw if mode.startswith("fused") else {}))

    calls = {
        "sageattn": lambda: sageattn(q, k, v, tensor_layout="NHD"),
        "kernel_alone": lambda: BACKEND.attend(prepared),
    }
    for mode in MODES:
        calls[f"fast_{mode}"] = (lambda m: lambda: BACKEND.attend(prep(m)))(mode)
        calls[f"prepare_{mode}"] = (lambda m: lambda: prep(m))(mode)
    times = interleaved_times({n: event_timed(f) for n, f in calls.items()}, reps=reps, warmup=warmup)
    rows = {n: summary(t) for n, t in times.items()}
    for n, f in calls.items():
        extra, _ = peak_extra_bytes(f, torch.device("cuda"))
        rows[n]["peak_extra_mib"] = extra / 2**20
    ref = sageattn(q, k, v, tensor_layout="NHD")
    out = {m: BACKEND.attend(prep(m)) for m in MODES}
    alone = BACKEND.attend(prepared)
    p50 = {n: r["p50_seconds"] * 1e3 for n, r in rows.items()}
    return {
        "seq": seq, "heads": HEADS, "head_dim": D, "reps": reps, "v_div_mode": div_mode,
        "v_div_mode_mismatches": div_counts, "variants": rows,
        "exact_bit_identical_to_sageattn": bool(torch.equal(out["exact"], ref)),
        "kernel_alone_bit_identical_to_sageattn": bool(torch.equal(alone, ref)),
        "max_abs_vs_sageattn": {m: (o.float() - ref.float()).abs().max().item() for m, o in out.items()},
        "fast_minus_kernel_ms": {m: p50[f"fast_{m}"] - p50["kernel_alone"] for m in MODES},
        "sageattn_minus_kernel_ms": p50["sageattn"] - p50["kernel_alone"],
        "speedup_vs_sageattn": {m: p50["sageattn"] / p50[f"fast_{m}"] for m in MODES},
    }


QUANT_CONFIGS = ((1, 8), (4, 8), (1, 16), (4, 16))  # (unroll, warps) of the exact-mode quantisation pass


def tuning(seq, reps, warmup):
    """prepare() in exact mode under each quantisation-pass configuration, interleaved."""
    from sageattention import sageattn
    qkv, table, qw, kw = make_buffer(seq, 7)
    q, k, v = views(qkv)
    sage2_quant_ref.norm_rope_eager_(q, k, table, qw, kw, EPS)
    prepared = BACKEND.prepare(q, k, v, mode="exact")
    default = (sage2_quant.QUANT_UNROLL[False], sage2_quant.QUANT_WARPS[False])

    def with_config(cfg, fn):
        def run():
            sage2_quant.QUANT_UNROLL[False], sage2_quant.QUANT_WARPS[False] = cfg
            try:
                return fn()
            finally:
                sage2_quant.QUANT_UNROLL[False], sage2_quant.QUANT_WARPS[False] = default
        return run

    calls = {"sageattn": lambda: sageattn(q, k, v, tensor_layout="NHD"),
             "kernel_alone": lambda: BACKEND.attend(prepared),
             "fast_exact": lambda: BACKEND.attend(BACKEND.prepare(q, k, v, mode="exact"))}
    for cfg in QUANT_CONFIGS:
        calls[f"prepare_exact_u{cfg[0]}_w{cfg[1]}"] = with_config(cfg, lambda: BACKEND.prepare(q, k, v, mode="exact"))
    identical = {}
    for cfg in QUANT_CONFIGS:
        p = with_config(cfg, lambda: BACKEND.prepare(q, k, v, mode="exact"))()
        identical[f"u{cfg[0]}_w{cfg[1]}"] = all(bool(torch.equal(getattr(p, n).view(torch.uint8) if n == "v_fp8" else getattr(p, n),
                                                    getattr(prepared, n).view(torch.uint8) if n == "v_fp8" else getattr(prepared, n)))
                                              for n in ("q_int8", "q_scale", "k_int8", "k_scale", "v_fp8", "v_scale"))
    times = interleaved_times({n: event_timed(f) for n, f in calls.items()}, reps=reps, warmup=warmup)
    rows = {n: summary(t) for n, t in times.items()}
    for n, r in rows.items():
        print(f"tuning S={seq:,} {n:24s} p50 {r['p50_seconds'] * 1e3:8.3f} ms  spread {r['spread'] * 100:5.1f}%", flush=True)
    print(f"tuning S={seq:,} operands identical to the default configuration: {identical}", flush=True)
    return {"seq": seq, "reps": reps, "default": list(default), "variants": rows, "operands_identical": identical}


def concentrate(x, chans, ratio):
    """x [1, S, H, D]: per head, channels ``chans[h]`` scaled by ``ratio``, each row rescaled to its norm."""
    w = torch.ones(x.shape[2], D, device=x.device)
    w.scatter_(1, chans, float(ratio))
    y = x.float() * w
    y = y * (x.float().norm(dim=-1, keepdim=True) / y.norm(dim=-1, keepdim=True))
    return y.to(x.dtype)


def accuracy(seq, heads, seed=11):
    from sageattention import sageattn
    try:
        import comfy_kitchen
        ck = comfy_kitchen.int8_attention
        ck_reason = ""
    except Exception as exc:
        ck, ck_reason = None, f"comfy-kitchen not importable on this machine ({type(exc).__name__}: {exc})"
    g = torch.Generator(device="cuda").manual_seed(seed)
    cases = [("plain", 0, 1, False), ("k_mean_offset", 0, 1, True)]
    cases += [(f"k{n}_x{r}", n, r, False) for n in (1, 2, 4, 8) for r in (10, 100)]
    cases += [("k4_x100_offset", 4, 100, True)]
    rows = torch.cat([torch.arange(256), torch.arange(seq - 256, seq)]).cuda()
    results = {}
    for name, n, ratio, offset in cases:
        qkv = torch.randn(seq, 3 * heads * D, device="cuda", generator=g, dtype=torch.bfloat16)
        q, k, v = views(qkv, heads)
        if n:
            chans = torch.stack([torch.randperm(D, device="cuda", generator=g)[:n] for _ in range(heads)])
            q.copy_(concentrate(q, chans, ratio))
            k.copy_(concentrate(k, chans, ratio))
        if offset:
            k.add_((3 * torch.randn(heads, D, device="cuda", generator=g)).to(k.dtype))
        qt, kt, vt = (t[0, :, :].transpose(0, 1).float()[None] for t in (q, k, v))  # [1, H, S, D]
        ref = F.scaled_dot_product_attention(qt[:, :, rows], kt, vt).transpose(1, 2)[0]  # [R, H, D]
        outs = {
            "sageattn": sageattn(q, k, v, tensor_layout="NHD")[0, rows],
            "fast_exact": BACKEND.attend(BACKEND.prepare(q, k, v, mode="exact"))[0, rows],
            "fast_rotated": BACKEND.attend(BACKEND.prepare(q, k, v, mode="rotated"))[0, rows],
            "sdpa_bf16": F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                        v.transpose(1, 2)).transpose(1, 2)[0, rows],
        }
        if ck is not None:
            try:
                outs["comfy_kitchen_int8"] = ck(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)[0, rows]
            except Exception as exc:
                ck_reason = f"int8_attention failed ({type(exc).__name__}: {exc})"
                ck = None
        err = {m: ((o.float() - ref).norm() / ref.norm()).item() for m, o in outs.items()}
        results[name] = err
        print(f"accuracy S={seq} {name:16s} " + "  ".join(f"{m} {e * 100:.2f}%" for m, e in err.items()), flush=True)
        del qkv, q, k, v, qt, kt, vt, outs
    return {"seq": seq, "heads": heads, "rows": "first and last 256", "rel_l2_vs_fp32": results,
            "comfy_kitchen": ck_reason or "ran"}


def print_speed(r):
    print(f"\nS = {r['seq']:,}  ({r['heads']}x{r['head_dim']}, median of {r['reps']}, CUDA events)")
    print(f"{'variant':22s} {'p50 ms':>9s} {'spread':>7s} {'peak extra MiB':>15s}")
    for n, row in r["variants"].items():
        print(f"{n:22s} {row['p50_seconds'] * 1e3:9.3f} {row['spread'] * 100:6.1f}% {row['peak_extra_mib']:15.1f}")
    print("prepare+kernel minus kernel alone (ms): " + ", ".join(f"{m} {d:.3f}" for m, d in r["fast_minus_kernel_ms"].items())
          + f"; sageattn minus kernel alone {r['sageattn_minus_kernel_ms']:.3f}")
    print(f"exact bit-identical to sageattn: {r['exact_bit_identical_to_sageattn']}  "
          f"(kernel alone: {r['kernel_alone_bit_identical_to_sageattn']}); V division mode {r['v_div_mode']} "
          f"(mismatches per mode {r['v_div_mode_mismatches']})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("speed", "accuracy", "both", "tuning"), default="both")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--accuracy-seq", type=int, nargs="+", default=[8192])
    p.add_argument("--accuracy-heads", type=int, default=HEADS)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    q = torch.empty(1, 128, 1, D, dtype=torch.bfloat16, device="cuda")
    verdict = BACKEND.fast_path_verdict(q, q, q, layout="NHD")
    if not verdict:
        sys.exit(f"fast path unavailable: {verdict.reason}")
    cap = torch.cuda.get_device_capability()
    report = {"device": torch.cuda.get_device_name(), "compute_capability": f"SM{cap[0]}{cap[1]}",
              "torch": torch.__version__, "triton": getattr(sage2_quant.triton, "__version__", None),
              "speed": [], "accuracy": [], "tuning": []}
    if args.part == "tuning":
        for seq in args.seq:
            report["tuning"].append(tuning(seq, args.reps, args.warmup))
            if args.out:
                json.dump(report, open(args.out, "w"), indent=1)
        return
    if args.part in ("speed", "both"):
        for seq in args.seq:
            r = speed(seq, args.reps, args.warmup)
            report["speed"].append(r)
            print_speed(r)
            if args.out:
                json.dump(report, open(args.out, "w"), indent=1)
    if args.part in ("accuracy", "both"):
        for seq in args.accuracy_seq:
            report["accuracy"].append(accuracy(seq, args.accuracy_heads))
            if args.out:
                json.dump(report, open(args.out, "w"), indent=1)
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)
    for r in report["speed"]:
        print_speed(r)
    for a in report["accuracy"]:
        print(f"\naccuracy S={a['seq']:,} rel L2 vs fp32 (%), comfy-kitchen: {a['comfy_kitchen']}")
        methods = list(next(iter(a["rel_l2_vs_fp32"].values())))
        print(f"{'case':16s} " + " ".join(f"{m:>14s}" for m in methods))
        for case, err in a["rel_l2_vs_fp32"].items():
            print(f"{case:16s} " + " ".join(f"{err.get(m, float('nan')) * 100:14.2f}" for m in methods))


if __name__ == "__main__":
    main()
