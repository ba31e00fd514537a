"""H3's W4A8 linears alone at the bundled workflows' length on a GPU, after the route's first-use bits check:
comfy-kitchen's ``w4a8_int8_linear`` (stock's call) beside the int8 route (comfy-kitchen's decode to its int8 grid,
the pack's quantiser and GEMM), bit for bit, then ms a call as stock, pack, stock, pack (the lower of each pair)."""

from __future__ import annotations

import time

import torch

from devkit.pack import submodule

ROWS = 37810
LINEARS = {"qkv": (5376, 21504), "out": (7168, 5376), "fc2": (14336, 5376)}  # (in, out) of H3's W4A8-routed linears


def mean_ms(fn, calls: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> int:
    import comfy_kitchen as ck

    w4a8, route, kitchen = (submodule(f"kernels.{n}") for n in ("int8_w4a8", "int8_linear", "kitchen"))
    device = torch.device("cuda")
    print("comfy-kitchen", kitchen.installed_release()[0], torch.cuda.get_device_name(), flush=True)
    for bits, codebook in ((4, True), (4, False)):
        start = time.time()
        print("bits check", bits, codebook, w4a8._bits_problem(device, bits, codebook), f"{time.time() - start:.1f}s")
    for name, (k, n) in LINEARS.items():
        g = torch.Generator(device=device).manual_seed(0)
        x = (2 * torch.randn(ROWS, k, generator=g, device=device)).bfloat16()
        qdata, s_rel, s_channel, _, table = ck.quantize_w4a8_int8_weight(
            torch.randn(n, k, generator=g, device=device).bfloat16())
        choice = route.choice(device, k, n)

        def stock():
            return ck.w4a8_int8_linear(x, qdata, s_rel, s_channel, table, out_dtype=x.dtype)

        def pack():
            weight = kitchen.kitchen_cuda()[0]._dequant_int4_grouped_to_int8(qdata, s_rel, table, w4a8.GROUP_SIZE)
            return route.int8_linear_routed(x, weight, s_channel, None, kernel=choice)

        same = torch.equal(stock(), pack())
        times = [mean_ms(stock), mean_ms(pack), mean_ms(stock), mean_ms(pack)]
        st, pk = min(times[0], times[2]), min(times[1], times[3])
        print(f"{name} {ROWS}x{k}->{n}: stock {st:.2f} ms, pack {pk:.2f} ms ({choice.kernel}), {st / pk:.3f}x, "
              f"bits equal {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
