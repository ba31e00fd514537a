"""The sm90 attention prototype without a GPU: compiled for sm90 here, read from its machine code.

    python -m benchmarks.sm90_static                       # every prototype config
    python -m benchmarks.sm90_static --configs m128n128w8s3 --out static.json
    python -m benchmarks.sm90_static --configs ws_n128s4_pp_mmasum    # a warp-specialised Gluon config: the mean
                                                               # of its two consumer loops

Triton compiles for any target without a device, and its wheel carries ``ptxas``, ``cuobjdump`` and
``nvdisasm``. Per config this compiles ``benchmarks/sage2_prototype._prototype_kernel`` for sm90 with
the specialisations a real launch gets (every pointer and the operands' padded lengths divisible by
16), then reads the cubin: registers, stack frame (spills), shared memory, whether the products are
Hopper's wgmma (``IGMMA`` for int8 Q.K, ``QGMMA`` for fp8 P.V), and the main loop, one key block, as
the instruction mix one warp issues for it.

What follows from the loop (all warps run it: the kernel has no warp specialisation):
``thread instructions per score element = loop length x threads per CTA / (BLOCK_M x BLOCK_N)``, the
number Nsight Compute gave for SageAttention's own sm90 kernel (``sage2_kernel_profile``, 8.97 at
37,810). Two times follow for H3's attention (56 heads): the issue-bound floor, every scheduler
issuing one instruction a cycle, and the time at SageAttention's measured issue rate. The clock and
that rate come from the committed profile (``benchmarks/results/ncu``), not from a datasheet.
The prologue and the tail block are left out: at thousands of key blocks a row they are noise.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from benchmarks import sage2_prototype as proto
from benchmarks.triton_aot import check_compilable

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "benchmarks" / "results" / "ncu" / "sage2_sm90_kernel_profile.json"
SCHEDULERS = 132 * 4  # H200: 132 SMs, 4 warp schedulers each
H3_HEADS, H3_SEQS = 56, (8192, 37810)
MMA_OPCODES = ("IGMMA", "QGMMA", "HGMMA", "HMMA", "IMMA")


def triton_tool(name: str) -> str:
    """A CUDA binary tool shipped inside the Triton wheel."""
    import triton.backends.nvidia as nvidia

    path = Path(nvidia.__file__).parent / "bin" / name
    if not path.exists():
        raise SystemExit(f"sm90_static: this Triton has no {name} ({path}); install a CUDA build of Triton")
    return str(path)


def _run_tool(tool: str, args: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([triton_tool(tool), *args, f.name], check=True, capture_output=True, text=True).stdout


def resources(cubin: bytes) -> dict:
    """Registers per thread, stack frame bytes (spills land there) of the cubin's one kernel."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", _run_tool("cuobjdump", ["--dump-resource-usage"], cubin))
    if not found:
        raise ValueError("cuobjdump printed no resource usage")
    return {"registers": int(found[1]), "stack_bytes": int(found[2])}


def instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm's listing -> (instructions in order, label -> index of the instruction after it)."""
    listing, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label[1]] = len(listing)
            continue
        ins = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            listing.append(ins[1])
    return listing, labels


def opcode(instruction: str) -> str:
    """``@!P0 FFMA.FTZ R1, ...`` -> ``FFMA``."""
    return re.sub(r"^@!?U?P[T\d]+\s+", "", instruction).split()[0].split(".")[0]


def loop_spans(listing: list[str], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction of every loop: a label and the backward branch that returns to it.
    Branches past the last ``EXIT`` are left out: that is out-of-line code (the retry of an mbarrier
    wait, in kernels that load by TMA) jumping back into the body, not a loop."""
    exits = [i for i, ins in enumerate(listing) if opcode(ins) == "EXIT"]
    end = exits[-1] if exits else len(listing)
    spans = []
    for i, ins in enumerate(listing[:end]):
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if target and labels.get(target[1], i + 1) <= i:
            spans.append((labels[target[1]], i))
    return spans


def main_loop(listing: list[str], labels: dict[str, int]) -> list[str]:
    """The longest loop body."""
    loops = [listing[a:b + 1] for a, b in loop_spans(listing, labels)]
    if not loops:
        raise ValueError("no backward branch: the kernel has no loop")
    return max(loops, key=len)


def product_loops(listing: list[str], labels: dict[str, int]) -> list[list[str]]:
    """Innermost loops that issue both products (``IGMMA`` and ``QGMMA``), in program order: the one
    main loop of a Triton config, one per consumer warpgroup in a warp-specialised kernel (whose
    partitions also sit inside the worker dispatch loop, which these leave out)."""
    spans = [(a, b) for a, b in loop_spans(listing, labels)
             if {"IGMMA", "QGMMA"} <= {opcode(x) for x in listing[a:b + 1]}]
    inner = [a for a in spans if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in spans)]
    return [listing[a:b + 1] for a, b in sorted(inner)]


@dataclass
class Analysis:
    config: str
    registers: int
    stack_bytes: int
    shared_bytes: int
    loop_instructions: float  # a warp-specialised config: the mean of its consumers' loops
    per_score_element: float
    mma: dict
    mix: dict


def analyse(name: str) -> Analysis:
    """One config's machine code. A warp-specialised config's loop and mix are the mean of its two
    consumer warpgroups' loops (consumer 0 also issues the loads); per score element counts one
    warpgroup's 128 threads over its 64 rows x block_n keys."""
    from benchmarks import sage2_ws
    from benchmarks.triton_aot import compile_named

    kernel = compile_named(name)
    cubin, shared = kernel.asm["cubin"], int(kernel.metadata.shared)
    listing, labels = instructions(_run_tool("nvdisasm", ["-c"], cubin))
    if name in sage2_ws.WS_CONFIGS:
        cfg = sage2_ws.WS_CONFIGS[name]
        loops = product_loops(listing, labels)
        if len(loops) != sage2_ws.CONSUMERS:
            raise ValueError(f"{name}: expected one product loop per consumer warpgroup, found {len(loops)}")
        threads, rows = 32 * sage2_ws.NUM_WARPS, sage2_ws.ROWS
    else:
        cfg = proto.CONFIGS[name]
        loops = [main_loop(listing, labels)]
        threads, rows = 32 * cfg.num_warps, cfg.block_m
    mixes = [collections.Counter(opcode(i) for i in loop) for loop in loops]
    mix = collections.Counter({op: sum(m[op] for m in mixes) / len(mixes) for op in set().union(*mixes)})
    length = sum(len(loop) for loop in loops) / len(loops)
    return Analysis(name, **resources(cubin), shared_bytes=shared, loop_instructions=length,
                    per_score_element=length * threads / (rows * cfg.block_n),
                    mma={op: mix[op] for op in MMA_OPCODES if mix[op]}, mix=dict(mix.most_common()))


def profiled_kernel() -> dict:
    """SageAttention's sm90 kernel as profiled, by sequence length: its time, registers, instructions
    per score element, issue rate and the clock that follows from them."""
    out = {}
    for r in json.loads(PROFILE.read_text()):
        issue = r["issue_active_pct"] / 100
        clock = r["warp_instructions"] / (r["duration_ns"] * 1e-9 * SCHEDULERS * issue)
        out[r["seq"]] = {"ms": r["duration_ms"], "registers": int(r["registers_per_thread"]),
                         "per_element": r["thread_instructions_per_score_element"], "issue": issue, "clock_hz": clock}
    return out


def profile_clock_hz() -> float:
    """The highest SM clock the committed profile implies: the clock the issue floors take."""
    return max(k["clock_hz"] for k in profiled_kernel().values())


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table, as docs/BENCHMARKS.md holds it."""
    for cells in (header, ["---"] * len(header), *rows):
        print("| " + " | ".join(cells) + " |")


def pass_reader_cli(doc: str, argv, table: Callable[[float], list[dict]]) -> list[dict]:
    """The pass readers' command line (``--out``: the results as JSON): ``table(clock_hz)`` prints its
    table and returns the results."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = table(profile_clock_hz())
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


def estimates(per_element: float, profile: dict) -> dict:
    """Milliseconds of one H3 attention call: at full issue, and at SageAttention's measured issue rate."""
    est = {}
    for seq, kernel in sorted(profile.items()):
        warp_instructions = per_element * seq * seq * H3_HEADS / 32
        floor = warp_instructions / (SCHEDULERS * kernel["clock_hz"]) * 1e3
        est[seq] = {"issue_floor_ms": floor, "at_sage_issue_rate_ms": floor / kernel["issue"]}
    return est


def markdown(profile: dict, configs: list[dict]) -> str:
    """One row per config: resources, loop, instructions per score element, the H3 estimates."""
    seqs = sorted(profile)
    head = ("| config | registers | stack | shared | loop (warp instr.) | per score element | "
            + " | ".join(f"S = {s:,}: floor / at SageAttention's issue rate" for s in seqs) + " |")
    lines = [head, "|" + "---|" * (6 + len(seqs))]
    for s in seqs:
        k = profile[s]
        floor = estimates(k["per_element"], profile)[s]["issue_floor_ms"]
        lines.append(f"| SageAttention sm90 (profiled, S = {s:,}) | {k['registers']} | - | - | - | "
                     f"{k['per_element']:.2f} | "
                     + " | ".join(f"{floor:.2f} / {k['ms']:.2f} ms (measured, {100 * k['issue']:.0f}% issue)"
                                  if t == s else "" for t in seqs) + " |")
    for c in configs:
        cells = " | ".join(f"{e['issue_floor_ms']:.2f} / {e['at_sage_issue_rate_ms']:.2f} ms "
                           f"({profile[s]['ms'] / e['at_sage_issue_rate_ms']:.2f}x)" for s, e in c["estimates"].items())
        lines.append(f"| `{c['config']}` | {c['registers']} | {c['stack_bytes']} | {c['shared_bytes']:,} | "
                     f"{c['loop_instructions']} | {c['per_score_element']:.2f} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(proto.all_configs()))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", action="store_true", help="also print the table docs/BENCHMARKS.md holds")
    args = parser.parse_args(argv)
    check_compilable("sm90_static", args.configs)
    import triton

    profile = profiled_kernel()
    results = [analyse(n) for n in args.configs]
    print(f"sm90 machine code, Triton {triton.__version__}; H3 attention: {H3_HEADS} heads x 128")
    print(f"{'config':<22} {'regs':>4} {'stack':>5} {'smem':>6} {'loop':>5} {'/elem':>6}  "
          + "  ".join(f"S={s}: floor / at sage's issue" for s in sorted(profile)))
    for seq, k in sorted(profile.items()):
        print(f"  SageAttention sm90, S={seq}: {k['per_element']:.2f} /elem, {k['ms']:.2f} ms at "
              f"{100 * k['issue']:.0f}% issue and {k['clock_hz'] / 1e9:.2f} GHz "
              f"(floor {estimates(k['per_element'], profile)[seq]['issue_floor_ms']:.2f} ms)")
    configs = []
    for a in results:
        est = estimates(a.per_score_element, profile)
        cells = "  ".join(f"{e['issue_floor_ms']:7.2f} / {e['at_sage_issue_rate_ms']:7.2f} ms "
                          f"({profile[s]['ms'] / e['at_sage_issue_rate_ms']:.2f}x)" for s, e in est.items())
        print(f"{a.config:<22} {a.registers:>4} {a.stack_bytes:>5} {a.shared_bytes:>6} {a.loop_instructions:>5} "
              f"{a.per_score_element:>6.2f}  {cells}")
        top = ", ".join(f"{op} {n}" for op, n in list(a.mix.items())[:12])
        print(f"{'':<22} mma {a.mma}; loop mix: {top}")
        configs.append({**asdict(a), "estimates": est})
    print("(x) = SageAttention's profiled time / the prototype's estimate at the same issue rate")
    if args.markdown:
        print(markdown(profile, configs))
    payload = {"triton": triton.__version__, "profile": profile, "configs": configs}
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
