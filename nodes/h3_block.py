"""MiniMax H3: the block fast path, each DiT block's forward replaced by stock's computation in stock's order with
stock's bits (docs/ARCHITECTURE.md; the token chunks' rules: chunking.py; the int8 linears: int8_layers.py)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

from .. import kernels
from . import chunking, int8_layers
from .ownership import is_own, replaced_forward

BLOCK_PARAMS = ("self", "x", "t_emb", "mod_segments", "rope_freqs", "transformer_options")
# the module-level helpers stock's block forward uses, whose semantics the fast path reproduces
STOCK_HELPERS = ("_mod_scale_shift", "_mod_gate")
# what a block or MLP forward would pass ``comfy.ops.linear_input_act`` (0.36+) to fuse a norm or the residual into a
# linear: that rounds differently from stock H3's unfused block, which the fast path reproduces
FUSED_LINEAR_ARGS = ("act_weight", "act_eps", "residual", "residual_scale", "rms_norm", "gelu_tanh")


def missing(obj, *paths) -> list[str]:
    """``no <path>`` for each dotted attribute path of ``obj`` that is absent or None."""
    return [f"no {p}" for p in paths if functools.reduce(lambda o, n: getattr(o, n, None), p.split("."), obj) is None]


def structure_problems(block) -> list[str]:
    """What differs from the DiT block the fast path was written for (empty: it matches)."""
    problems = missing(block, "adaln_proj", "norm1", "norm2", "attn", "mlp", "mlp.fc1.weight", "mlp.fc2.weight")
    mlp = getattr(block, "mlp", None)
    if mlp is not None and "linear_input_act" not in type(mlp).forward.__code__.co_names:
        problems.append("MLP.forward no longer calls comfy.ops.linear_input_act")
    for where, fn in (("MLP.forward", getattr(type(mlp), "forward", None)), ("forward", type(block).forward)):
        code = getattr(fn, "__code__", None)  # the names it calls, keyword names and string constants included
        names = [] if code is None else [*code.co_names, *(c for c in code.co_consts if isinstance(c, str)),
                                         *(n for c in code.co_consts if isinstance(c, tuple) for n in c)]
        if fused := [a for a in FUSED_LINEAR_ARGS if a in names]:
            problems.append(f"{where} fuses into its linears ({', '.join(fused)}), which the fast path does not")
    params = tuple(inspect.signature(type(block).forward).parameters)
    if params not in (BLOCK_PARAMS, BLOCK_PARAMS + ("attention",)):
        problems.append(f"forward{params} differs from forward{BLOCK_PARAMS}[+attention]")
    module, code = sys.modules.get(type(block).__module__), getattr(type(block).forward, "__code__", None)
    if gone := [n for n in STOCK_HELPERS if getattr(module, n, None) is None or n not in getattr(code, "co_names", ())]:
        problems.append(f"the block forward no longer uses {', '.join(gone)}")
    return problems


def pending_modulation(h, shift, scale, segments) -> kernels.PendingModulation:
    """Stock's ``_mod_scale_shift`` of ``h`` (same expressions), owed: its parameters per segment."""
    return kernels.PendingModulation(h, [(a, b, 1.0 + scale[row].to(h.dtype), shift[row].to(h.dtype))
                                     for a, b, row in segments])


def pending_residual(x, gate, segments) -> kernels.PendingResidual:
    """Stock's ``_mod_gate`` (``x += other * gate`` per segment, in place) owed for an ``other`` to come: ``apply``
    adds it in one pass a segment, or the int8 GEMM computing ``other`` in its epilogue."""
    return kernels.PendingResidual(x, [(a, b, gate[row].to(x.dtype)) for a, b, row in segments])


def mlp_forward(mlp, h, linear, into=None):
    """Stock's ``MLP.forward(h)``: fc1, SwiGLU (folded into fc2's quantiser, or one pass with stock's bits), fc2;
    each through ``linear`` (int8_layers.caller). ``into``: a ``kernels.PendingResidual`` for fc2's output."""
    u = linear(mlp.fc1, h)
    if chunking.folds_swiglu(mlp.fc2):
        return linear(mlp.fc2, u, "swiglu", into=into)
    return linear(mlp.fc2, kernels.swiglu(u), into=into)


class H3BlockForward:
    """Replacement for one H3 ``DiTBlock.forward`` (0.33's arguments and current upstream's ``attention=``)."""

    sage_strided_nhd = True  # ownership mark (see ownership.py)

    def __init__(self, block, patch):
        self.block = block
        self.patch = patch

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        blk = self.block
        if self.patch.embedding is not None:  # the first block of a model call: stock's video embedding is dead
            self.patch.embedding.release(x)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = blk.adaln_proj(t_emb)
        # the modulation owed: the qkv projection's int8 quantiser applies it where it takes the call
        handed = [pending_modulation(blk.norm1(x), shift_msa, scale_msa, mod_segments)]
        if attention is None and is_own(vars(blk.attn).get("forward")):
            # ours adds the gated output to x (in out_proj's int8 GEMM epilogue where it runs)
            x = blk.attn(handed, rope_freqs=rope_freqs, transformer_options=transformer_options,
                         into=pending_residual(x, gate_msa, mod_segments))
        else:  # a block replace's attention, or another node's attention forward: a tensor, as stock hands it
            out = (attention or blk.attn)(kernels.settled(handed.pop()), rope_freqs=rope_freqs,
                                          transformer_options=transformer_options)
            x = pending_residual(x, gate_msa, mod_segments).apply(out)
            del out
        return self._mlp_half(x, shift_mlp, scale_mlp, gate_mlp, mod_segments)

    def _mlp_half(self, x, shift, scale, gate, segments):
        """``x += mlp(modulate(norm2(x))) * gate``, by token chunks where they give the same bits. The MLP's
        input goes as its normed rows with the modulation still owed (fc1's int8 quantiser applies it)."""
        blk, settings, report = self.block, self.patch.settings, self.patch.report
        linear, routes = int8_layers.caller(self.patch), self.patch.plan.int8_routes
        plan = chunking.mlp_chunking(blk.mlp, x, chunking.mlp_chunk_setting(settings, blk.mlp), routes)
        normed = None
        with contextlib.ExitStack() as held:
            if chunking.CAST_ONCE in plan.modes:
                # no cast may run between the chunks: one could take the offload buffer a held weight lies in,
                # so a norm2 that casts its weight runs once, on every row, as stock runs it (one [S, hidden])
                if not chunking.weight_resident(blk.norm2, x.device):
                    normed = blk.norm2(x)
                # fc1's and fc2's cast weights held together: small beside fc1's [S, 2*ffn] output the chunks avoid
                acts = (None, "swiglu" if chunking.folds_swiglu(blk.mlp.fc2) else None)
                casts = [(layer, act) for layer, act, mode in zip((blk.mlp.fc1, blk.mlp.fc2), acts, plan.modes)
                         if mode == chunking.CAST_ONCE]
                linear = chunking.hold_casts(held, linear, casts, x, report.record_int8, routes)
                if linear is None:  # the casts shared a buffer: the MLP runs whole, as stock calls it
                    plan, linear = chunking.Chunking(), int8_layers.caller(self.patch)
            if plan.rows is None:
                h = pending_modulation(blk.norm2(x) if normed is None else normed, shift, scale, segments)
                del normed
                if replaced_forward(blk.mlp):
                    return pending_residual(x, gate, segments).apply(blk.mlp(kernels.settled(h)))
                return mlp_forward(blk.mlp, h, linear, into=pending_residual(x, gate, segments))
            for a, b in kernels.token_chunks(x.shape[0], plan.rows):
                segs = kernels.clip_segments(segments, a, b)
                h = pending_modulation(blk.norm2(x[a:b]) if normed is None else normed[a:b], shift, scale, segs)
                mlp_forward(blk.mlp, h, linear, into=pending_residual(x[a:b], gate, segs))
                del h
        return x


def block_keys(diffusion_model) -> list[str]:
    return [f"diffusion_model.blocks.{i}.forward" for i in range(len(diffusion_model.blocks))]
