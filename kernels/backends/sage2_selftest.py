"""Before sage2 is trusted on a device: a probe of the declared shape of the SageAttention entry points the pack
calls, then each of them once on a small problem against float32 SDPA. A build whose sm90 binding returns output the
kernel never wrote (SageAttention 2.2.0's release tag, fixed upstream by PR #307 under the same version) is caught
here; sage2 is then off on that device and the reason goes to the log and the report."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import sys
import time

import torch
import torch.nn.functional as F

from .. import sage2_quant
from . import sage2_binding
from .base import YES, Verdict, no

log = logging.getLogger("sage_strided_nhd")

SM90_OP = sage2_binding.SM90_OP
# Its arguments in the order ``Sage2Backend.attend`` passes them, as SageAttention registers the op; one return.
SM90_ARGS = ("query", "key", "value", "output", "query_scale", "key_scale", "value_scale", "tensor_layout",
             "is_causal", "qk_quant_gran", "sm_scale", "return_lse")
SAGEATTN_KEYWORDS = ("tensor_layout", "is_causal", "sm_scale")
# Few heads, a length that is no multiple of SageAttention's 128-token blocks, H3's head_dim, bf16.
HEADS, TOKENS, HEAD_DIM = 4, 320, 128
SCALE = 1.5 * HEAD_DIM ** -0.5  # not SageAttention's default: a binding that drops sm_scale is off by far more
# Worst head's relative L2 error against float32 SDPA (computed after the call). Int8 Q/K and fp8 P/V stay several
# times below it; output never written (NaN, zeros, stale memory) or another problem's is near 1 or more, or not finite.
MAX_RELATIVE_ERROR = 0.15


class CheckFailed(Exception):
    """An entry point raised or returned the wrong shape; the message names it."""


def self_test(backend, device: torch.device) -> Verdict:
    """The probe, then every entry point against the reference: YES, or ``self_test_failed`` with the reason."""
    start = time.perf_counter()
    try:
        problem = probe(backend, device)
        errors = {} if problem else measure(backend, device)
    except CheckFailed as exc:
        problem, errors = str(exc), {}
    except Exception as exc:  # a check that raises fails the test; it never fails the caller's call
        problem, errors = f"raised {type(exc).__name__}: {exc}", {}
    if not problem:
        worst = max(errors, key=lambda name: errors[name] if math.isfinite(errors[name]) else math.inf)
        if not errors[worst] <= MAX_RELATIVE_ERROR:
            what = "not finite (output never written?)" if not math.isfinite(errors[worst]) else f"{errors[worst]:.3f}"
            problem = f"{worst}: worst head's relative error {what}, limit {MAX_RELATIVE_ERROR}"
    ms = (time.perf_counter() - start) * 1e3
    if problem:
        log.warning("[Sage Strided NHD] sage2 self-test failed on %s, sage2 is off on this device: %s", device, problem)
        return no("self_test_failed", f"SageAttention 2 failed the self-test on {device}: {problem}")
    log.info("[Sage Strided NHD] sage2 self-test passed on %s: %d entry points, worst relative error %.3f "
             "(limit %s), %.0f ms", device, len(errors), max(errors.values()), MAX_RELATIVE_ERROR, ms)
    return YES


def probe(backend, device) -> str:
    """'' when the entry points the pack calls on ``device`` have the declared shape it calls them with."""
    try:
        params = inspect.signature(backend._sageattn).parameters
    except (TypeError, ValueError):  # a compiled callable without a signature: the numbers decide
        params = dict.fromkeys(SAGEATTN_KEYWORDS)
    missing = [name for name in SAGEATTN_KEYWORDS if name not in params]
    if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return f"sageattn takes no {', '.join(missing)}"
    if not sage2_binding.on_sm90(device):
        return ""
    op, _ = sage2_binding.sm90_attention_op()  # None: the prepared path is off, and says why
    binding = getattr(sys.modules.get("sageattention.sm90_compile"), SM90_OP, None)
    if inspect.isfunction(binding):  # the release tag's fake implementation took the op's name; sageattn calls it
        return (f"sageattention.sm90_compile.{SM90_OP} is a plain function, not the registered op: a SageAttention "
                "2.2.0 build without the sm90 binding fix (upstream PR #307), whose output is never written")
    if op is None:
        return ""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    if schema is None:
        return f"{SM90_OP} is not a registered torch op"
    names = tuple(a.name for a in schema.arguments)
    if names != SM90_ARGS or len(schema.returns) != 1:
        return (f"{SM90_OP} is declared ({', '.join(names)}) -> {len(schema.returns)} values; the pack calls "
                f"({', '.join(SM90_ARGS)}) -> 1")
    return ""


def measure(backend, device) -> dict[str, float]:
    """Entry point -> worst head's relative L2 error against float32 SDPA, each on its own random problem."""
    errors = {}
    for seed, (name, call) in enumerate(entry_points(backend, device).items()):
        q, k, v = _problem(seed, device)  # its own problem: stale memory holds no answer to it
        try:
            out = call(q, k, v)
        except Exception as exc:
            raise CheckFailed(f"{name} raised {type(exc).__name__}: {exc}") from exc
        if tuple(out.shape) != tuple(q.shape):
            raise CheckFailed(f"{name} returned shape {list(out.shape)}, expected {list(q.shape)}")
        ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), scale=SCALE)
        diff = (out.float().transpose(1, 2) - ref).flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1)
        errors[name] = float(diff.max()) if bool(diff.isfinite().all()) else math.nan
    return errors


def entry_points(backend, device) -> dict:
    """Name -> f(q, k, v) -> NHD output: every way the pack calls SageAttention on ``device``."""
    calls = {
        "sageattn NHD on strided views": lambda q, k, v: backend(q, k, v, layout="NHD", scale=SCALE),
        "sageattn HND": lambda q, k, v: backend(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), layout="HND",
                                                scale=SCALE).transpose(1, 2),
        "sageattn NHD by head chunks": lambda q, k, v: _by_head_chunks(backend, q, k, v),
    }
    if (sage2_binding.on_sm90(device) and sage2_quant.TRITON_ERROR is None
            and sage2_binding.sm90_attention_op()[0] is not None):
        for mode in sage2_quant.MODES:
            calls[f"sm90 binding, prepared {mode}"] = lambda q, k, v, mode=mode: _prepared(backend, mode, q, k, v)
    return calls


def _problem(seed, device):
    """Strided NHD views q, k, v [1, S, H, D] of one fused qkv buffer, as the projection writes it (bf16)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(TOKENS, 3, HEADS, HEAD_DIM, generator=g)
    qkv[:, 1] += torch.randn(HEADS, HEAD_DIM, generator=g)  # a key mean, as real keys have: SageAttention smooths it
    return qkv.to(device, torch.bfloat16).unsqueeze(0).unbind(2)


def _by_head_chunks(backend, q, k, v):
    """As the chain's head chunks call it: compact copies of head ranges, each output copied into its place."""
    out = torch.full_like(q, math.nan)
    for h0, h1 in ((0, 1), (1, q.shape[2])):
        out[:, :, h0:h1] = backend(*(t[:, :, h0:h1].contiguous() for t in (q, k, v)), layout="NHD", scale=SCALE)
    return out


def _prepared(backend, mode, q, k, v):
    """The pack's own operands, the binding launched per head chunk (two) into an output pre-filled with NaN."""
    prepared = dataclasses.replace(backend.prepare(q, k, v, mode=mode, scale=SCALE), head_chunks=((0, 1), (1, HEADS)))
    return backend.attend(prepared, out=torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device))
