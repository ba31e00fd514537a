"""Where SageAttention 2's sm90 kernel spends its time on the pack's prepared operands (Nsight Compute).

    python -m benchmarks.sage2_kernel_profile --seq 8192 37810 --out DIR     # driver: runs ncu per S
    python -m benchmarks.sage2_kernel_profile --target --seq 8192            # what ncu launches
    python -m benchmarks.sage2_kernel_profile --seq 8192 --out DIR --aot CUBINS \
        --prototype m64n128w4s3_cvt_groupk                                 # also the prototype's configs

``--prototype NAME`` (repeatable) profiles the attention prototype's config NAME (a Triton one or a
Gluon ``ws_*`` one), launched from the ahead-of-time cubins in ``--aot`` (``benchmarks/triton_aot``), on
the same operands, beside SageAttention's kernel, with the same sections and summary.

The target prepares H3-shaped operands (56x128 heads, bf16 inputs, ``sage2_prep = exact``) with the
pack's own passes, runs the kernel once to warm up, then once inside a profiler range; the driver
profiles that one launch with ``ncu --clock-control none`` (the card's clocks are left as they are)
and writes the raw metrics (CSV) and a summary JSON: elapsed time, achieved int8/fp8 TOPS, pipe
utilisation (tensor, FMA, ALU, XU), issue-slot use, IPC, warp stall reasons, and instructions per
score element (warp instructions x 32 / (S * S * H)), from which the ceiling follows.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

HEADS, D = 56, 128
KERNEL = "regex:qk_int8_sv_f8"
PROTOTYPE_KERNEL = "regex:^(_prototype_kernel|_ws_kernel)$"  # the Triton prototype's, the Gluon one's
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "InstructionStats", "WarpStateStats", "SchedulerStats",
            "Occupancy", "LaunchStats")
# summary keys -> the ncu metric names read for them (the first one present is used)
METRICS = {
    "duration_ns": ("gpu__time_duration.sum",),
    "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "tensor_pipe_pct": ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
                        "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active"),
    "fma_pipe_pct": ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
                     "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    "alu_pipe_pct": ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
                     "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    "xu_pipe_pct": ("sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",),
    "issue_active_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active",),
    "ipc": ("sm__inst_executed.avg.per_cycle_active", "smsp__inst_executed.avg.per_cycle_active"),
    "warp_instructions": ("smsp__inst_executed.sum", "sm__inst_executed.sum"),
    "threads_per_cta": ("launch__block_size",),
    "registers_per_thread": ("launch__registers_per_thread",),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def target(seq: int, prototype: str | None = None, aot: str | None = None) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from devkit.inputs import fused_attention_inputs
    from devkit.pack import kernels

    k = kernels()
    backend = k.BACKENDS["sage2"]
    verdict = backend.available()
    if not verdict:
        raise SystemExit(f"sage2 not available: {verdict.reason}")
    qkv, table, qw, kw = fused_attention_inputs(seq, HEADS, seed=5)
    q, k_, v = k.split_fused_qkv(qkv, HEADS, D)
    prepared = backend.prepare(q, k_, v, mode="exact", norm=k.QKNorm(rope_table=table, q_weight=qw, k_weight=kw,
                                                                     eps=1e-5))
    if prototype is None:
        def launch():
            backend.attend(prepared)
    else:
        from benchmarks import sage2_prototype as proto
        from benchmarks.triton_aot import Cubins
        cubins = Cubins(aot)

        def launch():
            proto.prototype_attention(prepared.operands, prepared.sm_scale, config=prototype, aot=cubins)
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def raw_name(seq: int, prototype: str | None) -> str:
    return f"sage2_sm90_kernel_S{seq}.csv" if prototype is None else f"prototype_{prototype}_S{seq}.csv"


def run_ncu(seq: int, out: Path, prototype: str | None = None, aot: str | None = None) -> Path:
    raw = out / raw_name(seq, prototype)
    kernel = KERNEL if prototype is None else PROTOTYPE_KERNEL
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", kernel,
           "--launch-count", "1", "--csv", "--page", "raw", "--metrics", "smsp__inst_executed.sum"]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, "-m", "benchmarks.sage2_kernel_profile", "--target", "--seq", str(seq)]
    if prototype is not None:
        cmd += ["--prototype", prototype, "--aot", str(aot)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    raw.write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"ncu failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}")
    return raw


def parse(raw: Path, seq: int) -> dict:
    text = raw.read_text()
    start = text.find('"ID"')
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, units, values = rows[0], rows[1], rows[2]
    table = {h: (val, unit) for h, unit, val in zip(header, units, values)}

    def number(name):
        value = table.get(name, ("", ""))[0].replace(",", "")
        try:
            return float(value)
        except ValueError:
            return None

    summary = {"seq": seq, "heads": HEADS, "head_dim": D}
    for key, names in METRICS.items():
        found = [(n, number(n)) for n in names if number(n) is not None]
        summary[key] = found[0][1] if found else None
        summary[key + "_metric"] = found[0][0] if found else None
    unit = table.get("gpu__time_duration.sum", ("", ""))[1]
    scale = {"ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "nsecond": 1e-9}.get(unit, 1e-9)
    seconds = summary["duration_ns"] * scale if summary["duration_ns"] else None
    summary["duration_ms"] = seconds * 1e3 if seconds else None
    ops = 4.0 * seq * seq * HEADS * D
    summary["tops"] = ops / seconds / 1e12 if seconds else None
    if summary["warp_instructions"]:
        summary["thread_instructions_per_score_element"] = summary["warp_instructions"] * 32 / (seq * seq * HEADS)
    stalls = {h[len(STALL_PREFIX):-len(STALL_SUFFIX)]: number(h) for h in header
              if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX) and number(h) is not None}
    summary["stall_reasons_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:10])
    summary["metrics_collected"] = len(header)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--target", action="store_true", help="the profiled program (ncu launches it)")
    p.add_argument("--out", default=".")
    p.add_argument("--parse-only", action="store_true", help="summarise the CSVs already in --out")
    p.add_argument("--prototype", action="append", default=[], metavar="CONFIG",
                   help="also profile this prototype config (repeatable; needs --aot)")
    p.add_argument("--aot", help="the prototype's ahead-of-time cubins (python -m benchmarks.triton_aot --out DIR)")
    args = p.parse_args(argv)
    if args.prototype and not args.aot:
        p.error("--prototype needs --aot DIR (the cubins benchmarks/triton_aot built)")
    if args.target:
        for seq in args.seq:
            target(seq, args.prototype[0] if args.prototype else None, args.aot)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(seq, None) for seq in args.seq] + [(seq, name) for name in args.prototype for seq in args.seq]
    raws = [out / raw_name(seq, name) if args.parse_only else run_ncu(seq, out, name, args.aot) for seq, name in runs]
    summaries = [dict(parse(raw, seq), kernel=name or "sage2_sm90") for raw, (seq, name) in zip(raws, runs)]
    profile = "sage2_sm90_kernel_profile.json" if not args.prototype else "sm90_kernels_profile.json"
    (out / profile).write_text(json.dumps(summaries, indent=1))
    for s in summaries:
        print(json.dumps({k: v for k, v in s.items() if not k.endswith("_metric")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
