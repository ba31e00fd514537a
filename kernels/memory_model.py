"""The activation memory of one H3 block call on the pack's fast path (nodes/h3_block.py, nodes/h3_patch.py, the
dataflow here), modelled from what each phase holds, so that ComfyUI can be told what the patched model needs.

Every term is a tensor the dataflow allocates; a phase is the set alive at its high point, the block's peak is the
largest phase. Bytes above the block's input (the residual stream it updates in place). Checked against peaks
measured on an H100 (37,810 and 8,192 packed tokens, bf16 and int8 ConvRot weights, tests/unit/test_memory_model.py)."""

from __future__ import annotations

from .offsets import token_chunks
from .sage2_quant import K_BLOCK, Q_BLOCK, padded_len, projected_chunks

WEIGHT_FORMATS = ("bf16", "int8")  # int8: int8 tensor-wise linears, their inputs quantised per row
# H3's DiT block (comfy/ldm/minimax/model.py defaults) and its rotated head dims (rope_inv_freq_len 16 x 3 axes x 2)
H3_DIMS = {"hidden": 5376, "heads": 56, "head_dim": 128, "ffn": 14336}
H3_VIDEO_PATCH = 96  # a video token's patch as the embedding takes it: latents_dim 24 x a 1x2x2 patch
H3_ROPE_DIMS = 96


def sage2_operand_bytes(seq: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(Q's, K's and V's) bytes of SageAttention 2's operands (sage2_quant._empty_operands): int8 Q with an fp32
    scale per 64-row block and 32 lanes, int8 K with one per 128-row block and 4 lanes, fp8 V padded to 128 rows."""
    q = heads * seq * head_dim + heads * -(-seq // Q_BLOCK) * 32 * 4
    kv = heads * seq * head_dim + heads * -(-seq // K_BLOCK) * 4 * 4 + heads * head_dim * padded_len(seq)
    return q, kv


def first_chunk(rows: int, chunk: int, align: int = 64) -> int:
    """Rows of the largest of ``kernels.token_chunks(rows, chunk, align)`` (the first)."""
    a, b = token_chunks(rows, chunk, align)[0]
    return b - a


def block_phases(tokens: int, *, hidden: int = H3_DIMS["hidden"], heads: int = H3_DIMS["heads"],
                 head_dim: int = H3_DIMS["head_dim"], ffn: int = H3_DIMS["ffn"], weights: str = "bf16",
                 act_bytes: int = 2, prepared: bool = True, chunked: bool = True, qkv_by_columns: bool = True,
                 cast_weights: bool = False, qkv_chunk_tokens: int = 8192, mlp_chunk_tokens: int = 12800,
                 int8_mlp_chunk_tokens: int = 8192) -> dict[str, int]:
    """Bytes alive at the high point of each phase of one block call at ``tokens`` packed rows.

    ``prepared``: SageAttention 2's sm90 prepared path takes the attention (else a plain kernel call). ``chunked``:
    the block's GEMMs may run on token chunks (bf16/fp16 on CUDA, rows independent: nodes/h3_block.py); the qkv
    projection then comes by ``qkv_chunk_tokens`` rows on the prepared path past that many rows, ``qkv_by_columns``
    where its weight is a plain or int8 product (K whole, Q by rows, then V; else whole rows, RowProjection without
    columns), and the MLP by the weight format's chunk setting. ``cast_weights``: ComfyUI casts each linear's weight
    for its calls (offloaded, streamed, DynamicVRAM): a cast lies beside its call's rows; chunked, it is cast once
    per block and held (the qkv weight through the attention, fc1's and fc2's through the MLP, beside norm2's rows
    taken whole)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; choose one of {WEIGHT_FORMATS}")
    if min(tokens, hidden, heads, head_dim, ffn, act_bytes) < 1:
        raise ValueError("tokens, dimensions and act_bytes must be positive")
    size = _Sizes(act_bytes, weights == "int8", cast_weights)
    if prepared and chunked and tokens > qkv_chunk_tokens:
        phases = _projected_attention(size, tokens, hidden, heads, head_dim, qkv_chunk_tokens, qkv_by_columns)
    else:
        phases = _whole_attention(size, tokens, hidden, heads, head_dim, prepared)
    inner = heads * head_dim
    phases["out projection"] = (size.rows(tokens, inner) + size.quantised(tokens, inner) + size.rows(tokens, hidden)
                                + size.weight(hidden, inner))
    chunk = int8_mlp_chunk_tokens if size.int8 else mlp_chunk_tokens
    return {**phases, **_mlp(size, tokens, hidden, ffn, first_chunk(tokens, chunk) if chunked and tokens > chunk
                             else tokens)}


class _Sizes:
    """Bytes of what the dataflow allocates, by weight format and whether weights are cast for their calls."""

    def __init__(self, act_bytes: int, int8: bool, cast_weights: bool):
        self.act_bytes, self.int8, self.cast_weights = act_bytes, int8, cast_weights

    def rows(self, n: int, width: int) -> int:
        return n * width * self.act_bytes

    def quantised(self, n: int, width: int) -> int:
        """The int8 activation quantiser's rows and fp32 row scales (int8_activation.quantize_rows); none in bf16."""
        return n * width + 4 * n if self.int8 else 0

    def weight(self, out_features: int, in_features: int) -> int:
        """A linear's weight as cast for its calls (int8 data stays int8); none where it lies on the device."""
        return out_features * in_features * (1 if self.int8 else self.act_bytes) if self.cast_weights else 0


def _projected_attention(size: _Sizes, s: int, hidden: int, heads: int, head_dim: int, qkv_chunk_tokens: int,
                         by_columns: bool) -> dict[str, int]:
    """The attention's phases where the prepared path takes the qkv projection by token chunks."""
    inner, rows, quantised = heads * head_dim, size.rows, size.quantised
    q_ops, kv_ops = sage2_operand_bytes(s, heads, head_dim)
    normed = rows(s, hidden)  # norm1's rows, the modulation applied in place or owed to the quantiser
    phases = {}
    if by_columns:
        # K of every row in one product while the call is planned, beside the input (and its int8 rows); then Q
        # by chunks of three times the setting's rows into Q's operands (sage2's prepare_projected), K's operand
        # and K freed; then V, the input released, and V's operand
        k_ops = kv_ops - heads * head_dim * padded_len(s)
        a, b = projected_chunks(s, qkv_chunk_tokens, by_columns=True)[0]  # the largest chunk is the first
        q_rows = b - a
        source = quantised(s, hidden) if size.int8 else normed  # the projection's input, kept until V is taken
        phases["k projection"] = normed + quantised(s, hidden) + rows(s, inner)
        phases["q by chunks"] = source + rows(s, inner) + q_ops + rows(q_rows, inner)
        phases["k operand"] = phases["v projection"] = source + rows(s, inner) + q_ops + k_ops
        phases["v operand"] = rows(s, inner) + q_ops + kv_ops
    else:
        # whole rows by chunks into an empty K/V buffer, each chunk quantised by its own linear call
        a, b = projected_chunks(s, qkv_chunk_tokens, by_columns=False)[0]
        q_rows = b - a
        kv = rows(s, 2 * inner)
        phases["q by chunks"] = normed + kv + q_ops + quantised(q_rows, hidden) + rows(q_rows, 3 * inner)
        phases["k/v operands"] = kv + q_ops + kv_ops  # the input released; K/V quantised beside their bf16 rows
    phases["attention"] = q_ops + kv_ops + rows(s, inner)  # K/V freed before the kernel writes its output
    qkv_weight = size.weight(3 * inner, hidden)
    return {name: nbytes + qkv_weight for name, nbytes in phases.items()}  # a weight cast once is held


def _whole_attention(size: _Sizes, s: int, hidden: int, heads: int, head_dim: int, prepared: bool) -> dict[str, int]:
    """The attention's phases where the fused qkv projection is made whole."""
    inner, rows = heads * head_dim, size.rows
    q_ops, kv_ops = sage2_operand_bytes(s, heads, head_dim)
    qkv = rows(s, 3 * inner)
    phases = {"qkv projection": rows(s, hidden) + size.quantised(s, hidden) + qkv + size.weight(3 * inner, hidden)}
    if prepared:
        phases["operands"] = qkv + q_ops + kv_ops
        phases["attention"] = q_ops + kv_ops + rows(s, inner)
    else:  # a plain call: the fused buffer's views, the kernel's own int8/fp8 copies (SageAttention's; no
        # fewer bytes than a FlashAttention-style kernel's) and its output
        phases["attention"] = qkv + q_ops + kv_ops + rows(s, inner)
    return phases


def _mlp(size: _Sizes, s: int, hidden: int, ffn: int, c: int) -> dict[str, int]:
    """The MLP's phases, by chunks of ``c`` rows (``c`` = ``s``: whole)."""
    rows, quantised = size.rows, size.quantised
    fc1, fc2 = size.weight(2 * ffn, hidden), size.weight(hidden, ffn)
    held = c < s and size.cast_weights  # cast once: both weights held, norm2 on every row (its chunks are views)
    # norm2's rows stay alive through the MLP; fc1's [c, 2*ffn] output through fc2, whose input is the SwiGLU
    # (bf16) or its int8 rows (the SwiGLU folded into fc2's quantiser)
    h = rows(s if held else c, hidden)
    return {"fc1": h + quantised(c, hidden) + rows(c, 2 * ffn) + fc1 + (fc2 if held else 0),
            "fc2": (h + rows(c, 2 * ffn) + (quantised(c, ffn) if size.int8 else rows(c, ffn)) + rows(c, hidden) + fc2
                    + (fc1 if held else 0))}


def block_peak_bytes(tokens: int, **how) -> int:
    """The pack's peak activation bytes of one H3 block call above its input (``block_phases``' largest)."""
    return max(block_phases(tokens, **how).values())


def model_call_bytes(tokens: int, block_peak: int, *, hidden: int = H3_DIMS["hidden"], act_bytes: int = 2,
                     rope_dims: int = H3_ROPE_DIMS, video_patch: int = H3_VIDEO_PATCH,
                     embedding_released: bool = False) -> int:
    """One H3 model call (batch 1) above what was allocated before it: what stock's forward holds through every
    block (the residual stream [S, hidden], the video embedding it was assembled from unless the first block
    released it, the fp32 patch rows, the rope rotation table [S, rope_dims/2, 2, 2]; every row counted as a video
    row), beside the larger of the block's peak and stock's embedding or final layer (an fp32 copy beside a bf16
    one of at most every row)."""
    streams = 1 if embedding_released else 2
    resident = streams * tokens * hidden * act_bytes + tokens * video_patch * 4 + tokens * rope_dims * 2 * act_bytes
    return resident + max(block_peak, tokens * hidden * (4 + act_bytes))
