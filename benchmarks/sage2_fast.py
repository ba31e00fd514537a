"""The sage2 sm90 prepared path on an H100/H200: speed, and int8 accuracy with outlier channels.

    python -m benchmarks.sage2_fast --out sage2-fast.json

Speed: strided NHD views [1, S, 56, 128] of one fused bf16 buffer, normed and roped; interleaved, CUDA events,
median of ``--reps``: ``sageattn`` (its own preparation inside), ``kernel_alone`` (``attend()`` on operands
prepared once), ``prepared_<mode>`` (``prepare()`` + ``attend()``), ``prepare_<mode>``; peak extra memory of
one call each; whether exact mode is sageattn's bits.

Accuracy: relative L2 error against fp32 attention (first and last 256 query rows) of random Q/K/V, keys whose
energy sits in 1-8 of 128 channels at 10x-100x (as a norm weight's gain puts them), a K mean offset, and the
channels concentrated in Q and K at constant row norm; for sageattn, both modes, SDPA in bf16 and comfy-kitchen's
int8_attention. Each mode's error split by source: Q/K int8 alone, all operands dequantised (the rest is the
kernel's own fp8 P).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from devkit import sage2_oracle
from devkit.inputs import fused_attention_inputs
from devkit.pack import kernels as _kernels

from .measure import device_facts, event_timed, interleaved_times, peak_extra_bytes, summary

BACKEND = _kernels().BACKENDS["sage2"]
HEADS, D, ROT, EPS = 56, 128, 96, 1e-5
MODES = ("exact", "rotated")


def views(qkv, heads=HEADS):
    return qkv.unflatten(1, (3, heads, D)).unsqueeze(0).unbind(2)


def speed_calls(q, k, v) -> dict:
    from sageattention import sageattn

    prepared = BACKEND.prepare(q, k, v, mode="exact")
    calls = {"sageattn": lambda: sageattn(q, k, v, tensor_layout="NHD"), "kernel_alone": lambda: BACKEND.attend(prepared)}
    for mode in MODES:
        calls[f"prepared_{mode}"] = lambda mode=mode: BACKEND.attend(BACKEND.prepare(q, k, v, mode=mode))
        calls[f"prepare_{mode}"] = lambda mode=mode: BACKEND.prepare(q, k, v, mode=mode)
    return calls


def speed(seq: int, reps: int, warmup: int) -> dict:
    qkv, table, qw, kw = fused_attention_inputs(seq, HEADS, D, ROT, seed=7, weight_mean=1.0, weight_spread=0.2,
                                                table_dtype=torch.float32)
    q, k, v = views(qkv)
    sage2_oracle.norm_rope_eager_(q, k, table, qw, kw, EPS)
    calls = speed_calls(q, k, v)
    times = interleaved_times({n: event_timed(f) for n, f in calls.items()}, reps=reps, warmup=warmup)
    rows = {n: summary(t) for n, t in times.items()}
    for n, f in calls.items():
        rows[n]["peak_extra_mib"] = peak_extra_bytes(f, torch.device("cuda"))[0] / 2**20
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


def accuracy_cases():
    """(name, k channels, ratio, K mean offset, construction: "gain" scales K's channels, "normed" Q's and K's)."""
    cases = [("plain", 0, 1, False, "gain"), ("k_mean_offset", 0, 1, True, "gain")]
    cases += [(f"k{n}_x{r}", n, r, False, "gain") for n in (1, 2, 4, 8) for r in (10, 30, 100)]
    cases += [("k4_x100_offset", 4, 100, True, "gain"), ("qk4_x100_normed", 4, 100, False, "normed")]
    return cases


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


def comfy_kitchen_attention():
    try:
        import comfy_kitchen
        return comfy_kitchen.int8_attention, ""
    except Exception as exc:
        return None, f"comfy-kitchen not importable on this machine ({type(exc).__name__}: {exc})"


def case_outputs(q, k, v, rows, prepared, kitchen) -> dict:
    from sageattention import sageattn

    def hnd(t):
        return t.transpose(1, 2)
    outs = {"sageattn": sageattn(q, k, v, tensor_layout="NHD")[0, rows],
            **{f"prepared_{m}": BACKEND.attend(p)[0, rows] for m, p in prepared.items()},
            "sdpa_bf16": F.scaled_dot_product_attention(hnd(q), hnd(k), hnd(v)).transpose(1, 2)[0, rows]}
    try:
        if kitchen is not None:
            outs["comfy_kitchen_int8"] = kitchen(hnd(q), hnd(k), hnd(v)).transpose(1, 2)[0, rows]
    except Exception as exc:  # the other methods' errors still count; the row says comfy-kitchen's is missing
        print(f"comfy-kitchen int8_attention failed: {type(exc).__name__}: {exc}", flush=True)
    return outs


def accuracy(seq: int, heads: int = HEADS, seed: int = 11) -> dict:
    kitchen, kitchen_reason = comfy_kitchen_attention()
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.cat([torch.arange(256), torch.arange(seq - 256, seq)]).cuda()
    results, sources = {}, {}
    for case in accuracy_cases():
        q, k, v = case_inputs(seq, heads, case, g)
        ref = attention_rows(*(t[0].transpose(0, 1) for t in (q, k, v)), rows)  # [R, H, D] fp32
        prepared = {m: BACKEND.prepare(q, k, v, mode=m) for m in MODES}
        results[case[0]] = {m: rel_l2(o, ref) for m, o in case_outputs(q, k, v, rows, prepared, kitchen).items()}
        sources[case[0]] = {m: error_sources(prepared[m].operands, v, rows, ref) for m in prepared}
        print(f"accuracy S={seq} {case[0]:16s} "
              + "  ".join(f"{m} {e * 100:.2f}%" for m, e in results[case[0]].items()), flush=True)
    return {"seq": seq, "heads": heads, "rows": "first and last 256", "rel_l2_vs_fp32": results,
            "error_sources": sources, "comfy_kitchen": kitchen_reason or "ran",
            "cases": {c[0]: dict(zip(("channels", "ratio", "k_mean_offset", "construction"), c[1:]))
                      for c in accuracy_cases()}}


def accuracy_verdict(a: dict) -> dict:
    """Rotated against exact where exact's error is over twice its plain error, against comfy-kitchen, on plain."""
    err = a["rel_l2_vs_fp32"]
    plain = err["plain"]["prepared_exact"]
    triggered = [c for c, e in err.items() if e["prepared_exact"] > 2 * plain]
    return {"outlier_cases_over_2x_plain": triggered,
            "rotated_at_most_half_of_sage2": {c: err[c]["prepared_rotated"] <= err[c]["prepared_exact"] / 2
                                              for c in triggered},
            "rotated_at_most_comfy_kitchen_int8": {c: e["prepared_rotated"] <= e["comfy_kitchen_int8"]
                                                   for c, e in err.items() if "comfy_kitchen_int8" in e},
            "rotated_no_worse_on_plain": err["plain"]["prepared_rotated"] <= err["plain"]["prepared_exact"]}


def unavailable() -> str | None:
    """Why the prepared path cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    available = BACKEND.available()
    if not available:
        return f"sage2 unavailable: {available.reason}"
    q = torch.empty(1, 128, 1, D, dtype=torch.bfloat16, device="cuda")
    verdict = BACKEND.prepared_verdict(q, q, q)
    return None if verdict else f"prepared path unavailable: {verdict.reason}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        sys.exit(why)
    report = {**device_facts("cuda"), "torch": torch.__version__, "speed": [], "accuracy": []}
    for part, run in (("speed", lambda s: speed(s, args.reps, args.warmup)), ("accuracy", accuracy)):
        for seq in args.seq:
            result = run(seq)
            if part == "accuracy":
                result["verdict"] = accuracy_verdict(result)
            report[part].append(result)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    for r in report["speed"]:
        print(f"S = {r['seq']:,}: " + ", ".join(f"{n} {row['p50_seconds'] * 1e3:.3f} ms ({row['spread']:.1%}, "
                                               f"{row['peak_extra_mib']:.0f} MiB)" for n, row in r["variants"].items())
              + f"; exact is sageattn's bits: {r['exact_bit_identical_to_sageattn']}")
    for a in report["accuracy"]:
        print(f"accuracy S={a['seq']:,}, comfy-kitchen: {a['comfy_kitchen']}; rotated: {json.dumps(a['verdict'])}")
    return report


if __name__ == "__main__":
    main()
