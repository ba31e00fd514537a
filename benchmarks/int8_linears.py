"""H3's four int8 ConvRot linears alone on a GPU, per linear and per block, interleaved (p50 of ``--reps``): stock's
layer, the pack's layer and quantiser, comfy-kitchen's and the pack's GEMMs (and the portable one) on the same
quantised rows, each output against stock's bit for bit (docs/BENCHMARKS.md, "The int8 GEMM")."""

from __future__ import annotations

import argparse
import sys

import torch

from devkit.pack import submodule

from .measure import event_timed, interleaved_times, summary
from .report import dump, markdown

HIDDEN, INNER, FFN = 5376, 7168, 14336
LINEARS = {"qkv": (HIDDEN, 3 * INNER, None), "out": (INNER, HIDDEN, None), "fc1": (HIDDEN, 2 * FFN, None),
           "fc2": (FFN, HIDDEN, "swiglu")}
GROUP = 256


def measure_linear(name: str, m: int, reps: int, warmup: int) -> dict:
    import comfy_kitchen as ck

    route, act_mod, gemm_mod, kitchen = (submodule(f"kernels.{n}")
                                         for n in ("int8_linear", "int8_activation", "int8_gemm", "kitchen"))
    k, n, act = LINEARS[name]
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = (2 * torch.randn(m, k * (2 if act else 1), generator=g, device="cuda")).bfloat16()
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    ws, bias = torch.tensor(3.1e-3, device="cuda"), torch.randn(n, generator=g, device="cuda").bfloat16()
    xq, xs = act_mod.quantize_rows(x, act)
    runners = {
        "stock_layer": lambda: ck.int8_linear(x, w, ws, bias, torch.bfloat16, convrot=True, convrot_groupsize=GROUP,
                                              input_act=act),
        "pack_layer": lambda: route.routed_or_reason(x, w, ws, bias, input_act=act),
        "pack_quantiser": lambda: act_mod.quantize_rows(x, act),
        "kitchen_gemm": lambda: kitchen.kitchen_gemm(xq, xs, w, ws, bias, torch.bfloat16),
    }
    chosen = gemm_mod.choice(x.device, k, n)
    gemm_why = chosen.reason if chosen.kernel == "comfy_kitchen" else None
    if gemm_why is None:
        runners["pack_gemm"] = lambda: gemm_mod.int8_gemm(xq, xs, w, ws, bias, kernel=chosen)
    portable = None
    if chosen.kernel == "pack_sm90":
        portable = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        runners["portable_gemm"] = lambda: gemm_mod._launch_portable(xq, xs, w, ws, bias, portable, None, chosen)
    want = runners["stock_layer"]()
    got = runners["pack_layer"]()
    route_problem = got if isinstance(got, str) else None  # why stock's call runs, or None: the route ran
    identical = route_problem is None and torch.equal(got, want)
    gemm_identical = gemm_why is None and torch.equal(runners["pack_gemm"](), runners["kitchen_gemm"]())
    if portable is not None:
        runners["portable_gemm"]()
        gemm_identical = gemm_identical and torch.equal(portable, runners["pack_gemm"]())
    del want, got
    times = interleaved_times({v: event_timed(f) for v, f in runners.items()}, reps, warmup)
    flops = 2 * m * n * k
    row = {"linear": name, "tokens": m, "in": k, "out": n, "input_act": act, "identical_to_stock": identical,
           "gemm_identical_to_kitchen": gemm_identical, "pack_gemm_problem": gemm_why,
           "route_problem": route_problem}
    for variant, ts in times.items():
        s = summary(ts)
        ms = round(s["p50_seconds"] * 1e3, 3)
        # the quantiser moves bytes, no MACs: bf16 input read once, int8 rows and fp32 scales written
        rate = (quantiser_speed(ms, x.numel() * x.element_size() + m * k + 4 * m) if variant == "pack_quantiser"
                else {"ms": ms, "tops": round(flops / s["p50_seconds"] / 1e12, 1)})
        row[variant] = {**rate, "spread": round(s["spread"], 3)}
    return with_speedups(row)


def quantiser_speed(ms: float, nbytes: int) -> dict:
    return {"ms": ms, "bytes": nbytes, "gbps": round(nbytes / ms / 1e6)}


def with_speedups(row: dict) -> dict:
    """``row`` with stock's layer time over the pack's, and comfy-kitchen's GEMM time over the pack's where it ran."""
    row["layer_speedup"] = round(row["stock_layer"]["ms"] / row["pack_layer"]["ms"], 3)
    if "pack_gemm" in row:
        row["gemm_speedup"] = round(row["kitchen_gemm"]["ms"] / row["pack_gemm"]["ms"], 3)
    return row


def block_sum(rows: list[dict]) -> dict:
    variants = [v for v in ("stock_layer", "pack_layer", "kitchen_gemm", "pack_gemm", "portable_gemm")
                if all(v in r for r in rows)]
    out = {"linear": "block (4 linears)", "tokens": rows[0]["tokens"],
           "identical_to_stock": all(r["identical_to_stock"] for r in rows)}
    flops = sum(2 * r["tokens"] * r["in"] * r["out"] for r in rows)
    for v in variants:
        ms = sum(r[v]["ms"] for r in rows)
        out[v] = {"ms": round(ms, 3), "tops": round(flops / (ms / 1e3) / 1e12, 1)}
    if all("pack_quantiser" in r for r in rows):
        out["pack_quantiser"] = quantiser_speed(round(sum(r["pack_quantiser"]["ms"] for r in rows), 3),
                                                sum(r["pack_quantiser"]["bytes"] for r in rows))
    return with_speedups(out)


def table(rows: list[dict]) -> str:
    def ms_tops(v: dict | None) -> str:
        return f"{v['ms']:.2f} ({v['tops']:,.0f})" if v else "-"

    header = ("linear", "tokens", "stock layer ms", "pack layer ms", "layer x", "pack quantiser ms (GB/s)",
              "comfy-kitchen GEMM ms (TOPS)", "pack GEMM ms (TOPS)", "GEMM x", "portable GEMM ms (TOPS)", "bits")
    return "\n".join(markdown(header, [
        (r["linear"], f"{r['tokens']:,}", f"{r['stock_layer']['ms']:.2f}", f"{r['pack_layer']['ms']:.2f}",
         f"{r['layer_speedup']:.3f}", f"{q['ms']:.2f} ({q['gbps']:,})" if (q := r.get("pack_quantiser")) else "-",
         ms_tops(r["kitchen_gemm"]), ms_tops(r.get("pack_gemm")),
         f"{r['gemm_speedup']:.3f}" if "pack_gemm" in r else "-", ms_tops(r.get("portable_gemm")),
         "identical" if r["identical_to_stock"] else "DIFFER") for r in rows]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[37810, 8192])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="results JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("[Sage Strided NHD] int8 linears: needs a CUDA GPU", file=sys.stderr)
        return 2
    route = submodule("kernels.int8_linear")
    kitchen_release = route.installed_release()[0]
    print(f"[Sage Strided NHD] {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"comfy-kitchen {kitchen_release}; int8 GEMM: {route.gemm_status()}")
    results = []
    for m in args.tokens:
        rows = [measure_linear(name, m, args.reps, args.warmup) for name in LINEARS]
        rows.append(block_sum(rows))
        results += rows
        print(table(rows), flush=True)
    dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "comfy_kitchen": kitchen_release,
          "gemm": route.gemm_status(), "reps": args.reps, "rows": results}, args.out)
    return 0 if all(r["identical_to_stock"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
