"""Which kernel PyTorch's SDPA runs under stock ComfyUI's priority and under the pack's, and whether
their outputs share bits.

    python -m benchmarks.sdpa_priority --seq 8192 12000 14000 37810 --out sdpa-priority.json
    python -m benchmarks.sdpa_priority --device cpu --seq 256 --heads 2 --head-dim 64   # smoke run

Stock ComfyUI's ``comfy.ops.scaled_dot_product_attention`` (0.33 to current) asks for FlashAttention
first (``STOCK_PRIORITY``); the pack's ``sdpa`` back-end asks for cuDNN attention first on Hopper and
newer (``kernels.backends.sdpa.HOPPER_PRIORITY``), where it is the faster kernel at H3's shape. Both
are SDPA, so the pack's ``sdpa`` equals stock's PyTorch attention exactly where the two orders pick
the same kernel. For each length this runs both orders and each kernel alone on the same random
strided NHD views of a fused qkv buffer (as H3's attention sees them), says which lone kernel's bits
each order reproduced, compares the two orders' outputs and times them interleaved.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.measure import device_timed, interleaved_times, max_abs_difference, summary
from devkit.pack import submodule

sdpa_backend = submodule("kernels.backends.sdpa")

STOCK_PRIORITY = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # comfy/ops.py
ORDERS = {"stock": STOCK_PRIORITY, "pack": sdpa_backend.HOPPER_PRIORITY}
LONE_KERNELS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def strided_views(seq: int, heads: int, head_dim: int, device, seed: int = 0):
    """q, k, v as [1, H, S, D] views of one [S, 3, H, D] bf16 buffer (no copies)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(seq, 3, heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    return tuple(qkv[:, i].unsqueeze(0).transpose(1, 2) for i in range(3))


def attend(names, q, k, v):
    """SDPA under the priority ``names`` (SDPBackend names); RuntimeError where no listed kernel runs."""
    factory = sdpa_backend.priority(names)
    if factory is None:
        raise RuntimeError("this PyTorch cannot set SDPA priorities (torch.nn.attention.sdpa_kernel)")
    with factory():
        return F.scaled_dot_product_attention(q, k, v)


def reproduced(out: torch.Tensor, lone: dict) -> list[str]:
    """The lone kernels whose output has ``out``'s bits (``lone``: name -> output, or None where it
    could not run)."""
    return [name for name, other in lone.items() if other is not None and torch.equal(out, other)]


def compare(seq: int, heads: int, head_dim: int, device, reps: int, warmup: int) -> dict:
    q, k, v = strided_views(seq, heads, head_dim, device)
    lone, unavailable = {}, {}
    for name in LONE_KERNELS:
        try:
            lone[name] = attend((name,), q, k, v)
        except RuntimeError as exc:
            lone[name], unavailable[name] = None, str(exc).splitlines()[0]
    outputs = {order: attend(names, q, k, v) for order, names in ORDERS.items()}
    row = {"seq": seq, "heads": heads, "head_dim": head_dim, "unavailable": unavailable,
           "ran": {order: reproduced(out, lone) for order, out in outputs.items()},
           "stock_vs_pack": max_abs_difference(outputs["stock"], outputs["pack"])}
    del lone, outputs
    runners = {order: device_timed(lambda names=names: attend(names, q, k, v), device)
               for order, names in ORDERS.items()}
    times = interleaved_times(runners, reps, warmup)
    row["times"] = {order: summary(t) for order, t in times.items()}
    return row


def line(row: dict) -> str:
    ran = "; ".join(f"{order} order ran {'/'.join(names) or 'no lone kernel'}" for order, names in row["ran"].items())
    diff = row["stock_vs_pack"]
    same = "same bits" if diff["bit_exact"] else f"differ, max abs {diff['max_abs_difference']:.3g}"
    p50 = {order: t["p50_seconds"] * 1e3 for order, t in row["times"].items()}
    return (f"S={row['seq']}: {ran}; stock vs pack: {same}; p50 stock {p50['stock']:.2f} ms, pack "
            f"{p50['pack']:.2f} ms ({p50['stock'] / p50['pack']:.3f}x)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sdpa_priority", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 12000, 14000, 37810])
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    if min(args.seq) < 1 or args.heads < 1 or args.head_dim < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--seq, --heads, --head-dim and --reps must be positive, --warmup at least 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; stock order {'/'.join(STOCK_PRIORITY)}, pack order "
          f"{'/'.join(ORDERS['pack'])}", flush=True)
    rows = []
    for seq in args.seq:
        rows.append(compare(seq, args.heads, args.head_dim, device, args.reps, args.warmup))
        print(line(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "orders": ORDERS, "results": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
