"""Attention alone on random H3-shaped inputs, one fused qkv buffer [S, 3*H*D] (56x128 heads), two reports
(docs/BENCHMARKS.md has the commands; ``--device cpu --seq 64 256 --heads 4`` is a CPU smoke run).

Layouts (the default): HND against strided NHD per back-end, interleaved, a fresh copy of the buffer each call (JSON
by back-end then S). ``--prepared``: the sage2 sm90 prepared path's speed, and its accuracy in ``ACCURACY_CASES``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from devkit import sage2_oracle
from devkit.backends import describe_backends
from devkit.inputs import fused_attention_inputs
from devkit.pack import kernels as _kernels

from . import measure
from .report import LAYOUTS, dump, markdown
from .results_table import KERNELS_HEADER, kernel_rows

kernels = _kernels()
MODES = ("exact", "rotated")
HEADS, D, ROT, EPS = 56, 128, 96, 1e-5  # H3's attention (the prepared path is measured at its shape)
SAGE2 = kernels.BACKENDS["sage2"]
# accuracy cases: (name, K's outlier channels, their gain, a K mean offset, construction: "gain" scales K's channels,
# "normed" Q's and K's at constant row norm)
ACCURACY_CASES = [("plain", 0, 1, False, "gain"), ("k_mean_offset", 0, 1, True, "gain"),
                  *((f"k{n}_x{r}", n, r, False, "gain") for n in (1, 2, 4, 8) for r in (10, 30, 100)),
                  ("k4_x100_offset", 4, 100, True, "gain"), ("qk4_x100_normed", 4, 100, False, "normed")]


def compare_layouts(pristine, norm: dict, heads: int, head_dim: int, backend: str, device, reps: int, warmup: int,
                    progress=None) -> dict:
    """Both layouts timed interleaved on fresh copies of ``pristine``, outputs compared; a named ``backend`` that did
    not run is refused. ``norm``: ``kernels.QKNorm``'s arguments (a QKNorm applies once)."""
    work = torch.empty_like(pristine)
    chain = kernels.BackendChain.for_choice(backend)

    def call(layout):
        return kernels.attention_from_fused_qkv(work, heads, head_dim, chain=chain, layout=layout,
                                                norm=kernels.QKNorm(**norm))

    def timer(layout):
        run = (measure.event_timed(lambda: call(layout)) if device.type == "cuda"
               else lambda: measure.timed(lambda: call(layout), device)[0])

        def rep():
            work.copy_(pristine)
            return run()
        return rep

    times = measure.interleaved_times({layout: timer(layout) for layout in LAYOUTS}, reps, warmup, progress=progress)
    row, outputs, records = {}, {}, {}
    for layout in LAYOUTS:
        work.copy_(pristine)
        peak, (out, rec) = measure.peak_extra_bytes(lambda: call(layout), device)
        if backend != "auto" and rec.backend != backend:
            raise RuntimeError(f"{backend} did not run ({[(s.backend, s.reason) for s in rec.skipped]}); "
                               "refusing to report it")
        outputs[layout], records[layout] = out.float().cpu(), dataclasses.asdict(rec)
        row.update({f"{layout}_mean_seconds": statistics.fmean(times[layout]),
                    f"{layout}_median_seconds": statistics.median(times[layout]),
                    f"{layout}_min_max_seconds": [min(times[layout]), max(times[layout])],
                    f"{layout}_peak_extra_bytes": peak})
    diff = measure.max_abs_difference(outputs["hnd"], outputs["strided_nhd"])
    return dict(row, speedup=row["hnd_median_seconds"] / row["strided_nhd_median_seconds"], speedup_basis="median",
                max_abs_difference=diff["max_abs_difference"], mean_abs_difference=diff["mean_abs_difference"],
                bit_exact=diff["bit_exact"], finite=measure.all_finite(*outputs.values()), records=records, reps=reps)


def views(qkv, heads=HEADS):
    return qkv.unflatten(1, (3, heads, D)).unsqueeze(0).unbind(2)


def speed(seq: int, reps: int, warmup: int) -> dict:
    qkv, table, qw, kw = fused_attention_inputs(seq, HEADS, D, ROT, seed=7, weight_mean=1.0, weight_spread=0.2,
                                                table_dtype=torch.float32)
    q, k, v = views(qkv)
    sage2_oracle.norm_rope_eager_(q, k, table, qw, kw, EPS)
    from sageattention import sageattn

    prepared = SAGE2.prepare(q, k, v, mode="exact")
    calls = {"sageattn": lambda: sageattn(q, k, v, tensor_layout="NHD"), "kernel_alone": lambda: SAGE2.attend(prepared)}
    for mode in MODES:
        calls[f"prepared_{mode}"] = lambda mode=mode: SAGE2.attend(SAGE2.prepare(q, k, v, mode=mode))
        calls[f"prepare_{mode}"] = lambda mode=mode: SAGE2.prepare(q, k, v, mode=mode)
    times = measure.interleaved_times({n: measure.event_timed(f) for n, f in calls.items()}, reps=reps, warmup=warmup)
    rows = {n: measure.summary(t) for n, t in times.items()}
    for n, f in calls.items():
        rows[n]["peak_extra_mib"] = measure.peak_extra_bytes(f, torch.device("cuda"))[0] / 2**20
    ref, alone = calls["sageattn"](), calls["kernel_alone"]()
    out = {m: calls[f"prepared_{m}"]() for m in MODES}
    p50 = {n: r["p50_seconds"] * 1e3 for n, r in rows.items()}
    return {
        "seq": seq, "heads": HEADS, "head_dim": D, "reps": reps, "variants": rows,
        "exact_bit_identical_to_sageattn": bool(torch.equal(out["exact"], ref)),
        "kernel_alone_bit_identical_to_sageattn": bool(torch.equal(alone, ref)),
        "max_abs_vs_sageattn": {m: (o.float() - ref.float()).abs().max().item() for m, o in out.items()},
        "prepared_minus_kernel_ms": {m: p50[f"prepared_{m}"] - p50["kernel_alone"] for m in MODES},
        "sageattn_minus_kernel_ms": p50["sageattn"] - p50["kernel_alone"],
        "speedup_vs_sageattn": {m: p50["sageattn"] / p50[f"prepared_{m}"] for m in MODES},
    }


def outlier_keys(k, chans, ratio):
    """k [1, S, H, D]: per head, channels ``chans[h]`` multiplied by ``ratio`` (as a norm weight's gain does)."""
    w = torch.ones(k.shape[2], D, device=k.device)
    w.scatter_(1, chans, float(ratio))
    return (k.float() * w).to(k.dtype)


def concentrate(x, chans, ratio):
    """x [1, S, H, D]: channels ``chans[h]`` scaled by ``ratio``, each row rescaled to its norm."""
    y = outlier_keys(x, chans, ratio).float()
    return (y * (x.float().norm(dim=-1, keepdim=True) / y.norm(dim=-1, keepdim=True))).to(x.dtype)


def rel_l2(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def attention_rows(q, k, v, rows):
    """fp32 attention of query rows ``rows``: q, k, v [H, S, D] -> [R, H, D]."""
    return F.scaled_dot_product_attention(q[None, :, rows].float(), k[None].float(), v[None].float())[0].transpose(0, 1)


def error_sources(ops, v, rows, ref):
    """A mode's error from Q/K int8 alone (V exact) and from all operands dequantised, both in fp32."""
    qd, kd, vd = sage2_oracle.dequantize_operands(ops)
    v_true = v[0].transpose(0, 1)
    return {"qk_int8_only": rel_l2(attention_rows(qd, kd, v_true, rows), ref),
            "operands_dequantised": rel_l2(attention_rows(qd, kd, vd, rows), ref)}


def case_inputs(seq: int, heads: int, case: tuple, g: torch.Generator):
    _, n, ratio, offset, construction = case
    q, k, v = views(torch.randn(seq, 3 * heads * D, device="cuda", generator=g, dtype=torch.bfloat16), heads)
    if n:
        chans = torch.stack([torch.randperm(D, device="cuda", generator=g)[:n] for _ in range(heads)])
        if construction == "normed":
            q.copy_(concentrate(q, chans, ratio))
            k.copy_(concentrate(k, chans, ratio))
        else:
            k.copy_(outlier_keys(k, chans, ratio))
    if offset:
        k.add_((3 * torch.randn(heads, D, device="cuda", generator=g)).to(k.dtype))
    return q, k, v


def case_outputs(q, k, v, rows, prepared, kitchen) -> dict:
    from sageattention import sageattn

    def hnd(t):
        return t.transpose(1, 2)

    outs = {"sageattn": sageattn(q, k, v, tensor_layout="NHD")[0, rows],
            **{f"prepared_{m}": SAGE2.attend(p)[0, rows] for m, p in prepared.items()},
            "sdpa_bf16": F.scaled_dot_product_attention(hnd(q), hnd(k), hnd(v)).transpose(1, 2)[0, rows]}
    try:
        outs["comfy_kitchen_int8"] = kitchen(hnd(q), hnd(k), hnd(v)).transpose(1, 2)[0, rows]
    except Exception as exc:  # the other methods' errors still count; the row says comfy-kitchen's is missing
        print(f"comfy-kitchen int8_attention failed: {type(exc).__name__}: {exc}", flush=True)
    return outs


def accuracy(seq: int, heads: int = HEADS, seed: int = 11) -> dict:
    from comfy_kitchen import int8_attention as kitchen

    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.cat([torch.arange(256), torch.arange(seq - 256, seq)]).cuda()
    results, sources = {}, {}
    for case in ACCURACY_CASES:
        q, k, v = case_inputs(seq, heads, case, g)
        ref = attention_rows(*(t[0].transpose(0, 1) for t in (q, k, v)), rows)  # [R, H, D] fp32
        prepared = {m: SAGE2.prepare(q, k, v, mode=m) for m in MODES}
        results[case[0]] = {m: rel_l2(o, ref) for m, o in case_outputs(q, k, v, rows, prepared, kitchen).items()}
        sources[case[0]] = {m: error_sources(prepared[m].operands, v, rows, ref) for m in prepared}
        print(f"accuracy S={seq} {case[0]:16s} "
              + "  ".join(f"{m} {e * 100:.2f}%" for m, e in results[case[0]].items()), flush=True)
    # the verdict: rotated against exact where exact's error is over twice its plain error, against comfy-kitchen,
    # and on plain inputs
    plain = results["plain"]["prepared_exact"]
    triggered = [c for c, e in results.items() if e["prepared_exact"] > 2 * plain]
    verdict = {"outlier_cases_over_2x_plain": triggered,
               "rotated_at_most_half_of_sage2": {c: results[c]["prepared_rotated"] <= results[c]["prepared_exact"] / 2
                                                 for c in triggered},
               "rotated_at_most_comfy_kitchen_int8": {c: e["prepared_rotated"] <= e["comfy_kitchen_int8"]
                                                      for c, e in results.items() if "comfy_kitchen_int8" in e},
               "rotated_no_worse_on_plain": results["plain"]["prepared_rotated"] <= plain}
    kitchen_ran = all("comfy_kitchen_int8" in e for e in results.values())
    return {"seq": seq, "heads": heads, "rows": "first and last 256", "rel_l2_vs_fp32": results,
            "error_sources": sources, "comfy_kitchen": "ran" if kitchen_ran else "failed (see the log)",
            "cases": {c[0]: dict(zip(("channels", "ratio", "k_mean_offset", "construction"), c[1:]))
                      for c in ACCURACY_CASES}, "verdict": verdict}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--prepared", action="store_true", help="the sage2 prepared path's speed and accuracy (sm90)")
    p.add_argument("--backends", nargs="+", choices=list(kernels.backends.AUTO_ORDER), help="default: all available")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--head-dim", type=int, default=D)
    p.add_argument("--rot-dim", type=int, default=ROT)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=440420)
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    if args.rot_dim > args.head_dim or args.rot_dim % 2:
        p.error(f"--rot-dim must be even and at most --head-dim ({args.head_dim})")
    return args


def layouts_main(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    availability = describe_backends(args.device)
    names = args.backends or [row["name"] for row in availability if row["available"]]
    report = {"environment": {**measure.device_facts(args.device), "torch": torch.__version__}, "heads": args.heads,
              "head_dim": args.head_dim, "dtype": args.dtype, "backends_available": availability, "results": {}}
    for name in names:
        verdict = kernels.BACKENDS[name].available()
        if not verdict:
            report["results"][name] = {"skipped": verdict.reason}
            continue
        report["results"][name] = {}
        for seq in args.seq:
            try:
                qkv, table, qw, kw = fused_attention_inputs(seq, args.heads, args.head_dim, args.rot_dim,
                                                            seed=args.seed, device=device, weight_mean=1.0,
                                                            weight_spread=0.1, table_dtype=dtype)
                norm = {"rope_table": table, "q_weight": qw.to(dtype), "k_weight": kw.to(dtype), "eps": 1e-5}
                row = compare_layouts(qkv.to(dtype), norm, args.heads, args.head_dim, name, device, args.reps,
                                      args.warmup)
            except Exception as exc:  # keep measuring the rest; the JSON says what failed
                row = {"error": f"{type(exc).__name__}: {exc}"}
            report["results"][name][str(seq)] = row
            dump(report, args.out)
            print(f"{name} S={seq}: " + (row.get("error") or f"HND {row['hnd_median_seconds'] * 1e3:.3f} ms, "
                  f"strided NHD {row['strided_nhd_median_seconds'] * 1e3:.3f} ms, speedup {row['speedup']:.3f}x"),
                  flush=True)
    env = report["environment"]
    print(f"\n{env['device']}, torch {env['torch']}, {args.heads}x{args.head_dim} heads {args.dtype}")
    print("\n".join(markdown(KERNELS_HEADER, kernel_rows(report, set()))))
    return report


def prepared_main(args) -> dict:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    available = SAGE2.available()
    if not available:
        sys.exit(f"sage2 unavailable: {available.reason}")
    q = torch.empty(1, 128, 1, D, dtype=torch.bfloat16, device="cuda")
    verdict = SAGE2.prepared_verdict(q, q, q)
    if not verdict:
        sys.exit(f"prepared path unavailable: {verdict.reason}")
    report = {**measure.device_facts("cuda"), "torch": torch.__version__, "speed": [], "accuracy": []}
    for part, run in (("speed", lambda s: speed(s, args.reps, args.warmup)), ("accuracy", accuracy)):
        for seq in args.seq:
            report[part].append(run(seq))
            dump(report, args.out)
    for r in report["speed"]:
        print(f"S = {r['seq']:,}: " + ", ".join(f"{n} {row['p50_seconds'] * 1e3:.3f} ms ({row['spread']:.1%}, "
                                               f"{row['peak_extra_mib']:.0f} MiB)" for n, row in r["variants"].items())
              + f"; exact is sageattn's bits: {r['exact_bit_identical_to_sageattn']}")
    for a in report["accuracy"]:
        print(f"accuracy S={a['seq']:,}, comfy-kitchen: {a['comfy_kitchen']}; rotated: {json.dumps(a['verdict'])}")
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    return prepared_main(args) if args.prepared else layouts_main(args)


if __name__ == "__main__":
    main()
