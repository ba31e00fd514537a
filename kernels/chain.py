"""The back-end chain: pick the first back-end that can take a call, fall back, report why.

Every decision is recorded in a :class:`CallRecord` returned with the output,
and each distinct fallback is logged once, so the caller can always say which
kernel actually ran.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from .backends import AUTO_ORDER, BACKENDS, AttentionBackend
from .offsets import fits, heads_per_chunk

log = logging.getLogger("sage_strided_nhd")

BACKEND_CHOICES = ("auto",) + tuple(sorted(BACKENDS, key=AUTO_ORDER.index))

_logged: set[tuple[str, str, str]] = set()


@dataclass
class CallRecord:
    """What one attention call did."""

    requested: str
    backend: str = ""
    layout: str = ""
    fallbacks: tuple[tuple[str, str], ...] = ()
    head_chunks: int = 1
    compacted: bool = False  # inputs copied into compact head chunks to keep int32 offsets in range
    copies: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["fallbacks"] = [{"backend": b, "reason": r} for b, r in self.fallbacks]
        return d


class NoBackendError(RuntimeError):
    """No back-end in the chain could take the call; the message lists every reason."""


@dataclass
class BackendChain:
    requested: str
    backends: list[AttentionBackend] = field(default_factory=list)

    @classmethod
    def for_choice(cls, choice: str, device=None) -> "BackendChain":
        """``auto``: every back-end, fastest first. A named back-end: it first, then the rest as fallbacks.

        ``device`` is the caller's target device; the chain itself decides per call from the tensors
        it is given, so the same chain serves a model that moves between devices.
        """
        if choice not in BACKEND_CHOICES:
            raise ValueError(f"unknown attention back-end {choice!r}; choose one of {', '.join(BACKEND_CHOICES)}")
        order = list(AUTO_ORDER)
        if choice != "auto":
            order.remove(choice)
            order.insert(0, choice)
        return cls(choice, [BACKENDS[name] for name in order])

    def run(self, q, k, v, *, layout: str, scale: float | None = None, mask=None):
        """Attention on q, k, v in ``layout``; returns (output in that layout, CallRecord)."""
        if layout not in ("NHD", "HND"):
            raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
        _check_shapes(q, k, v)
        record = CallRecord(self.requested, layout=layout)
        skipped: list[tuple[str, str]] = []
        for backend in self.backends:
            verdict = backend.available()
            if verdict:
                verdict = backend.supports(q, k, v, layout=layout, mask=mask)
            if not verdict:
                skipped.append((backend.name, verdict.reason, "unavailable" if not backend.available() else "unsupported"))
                continue
            try:
                out, chunks, compacted = _run_within_offsets(backend, q, k, v, layout, scale, mask)
            except torch.cuda.OutOfMemoryError:
                raise  # a smaller back-end won't help the caller more than a clear OOM
            except Exception as exc:
                _raise_if_context_lost(exc)
                skipped.append((backend.name, f"raised {type(exc).__name__}: {exc}", "raised"))
                continue
            record.backend, record.head_chunks, record.compacted = backend.name, chunks, compacted
            record.copies = 4 * chunks if compacted else 0  # 3 compact inputs + 1 output copy per chunk
            record.fallbacks = tuple((name, why) for name, why, _ in skipped)
            _log_fallbacks(self.requested, backend.name, skipped)
            return out, record
        reasons = "; ".join(f"{name}: {why}" for name, why, _ in skipped)
        raise NoBackendError(f"no attention back-end could run this call ({reasons})")


def _check_shapes(q, k, v):
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(f"q, k, v must be 4-D, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _raise_if_context_lost(exc: Exception) -> None:
    # An illegal access poisons the CUDA context: every later kernel fails too, so falling
    # back would only hide where it broke.
    if "illegal memory access" in str(exc) or "device-side assert" in str(exc):
        raise exc


def _run_within_offsets(backend: AttentionBackend, q, k, v, layout, scale, mask):
    """Call the back-end directly, or head by head-chunk when its int32 offsets would overflow.

    Returns (output, head chunks, compacted). Chunks are compact copies, so their offsets are
    bounded by their own size; each chunk's output is copied into one output tensor. A sequence
    whose compact copy fits whole runs as one compacted chunk.
    """
    limit = backend.max_element_offset
    seq_dim, head_dim_index = (1, 2) if layout == "NHD" else (2, 1)
    if limit is None or fits((q, k, v), seq_dim, backend.row_block, limit):
        return backend(q, k, v, layout=layout, scale=scale, mask=mask), 1, False
    if mask is not None:
        raise ValueError("head chunking with an attention mask is not supported")
    per_chunk = heads_per_chunk(q, k, head_dim_index, seq_dim, backend.row_block, limit)
    if per_chunk < 1:
        raise ValueError(f"sequence too long for {backend.name}: one head exceeds its int32 offset range")
    heads = q.shape[head_dim_index]
    out = None
    chunks = 0
    for start in range(0, heads, per_chunk):
        n = min(per_chunk, heads - start)
        part = [t.narrow(head_dim_index, start, n).contiguous() for t in (q, k, v)]
        o = backend(*part, layout=layout, scale=scale)
        if out is None:
            shape = list(q.shape)
            out = torch.empty(shape, dtype=o.dtype, device=o.device)
        out.narrow(head_dim_index, start, n).copy_(o)
        chunks += 1
    return out, chunks, True


def _log_fallbacks(requested: str, used: str, skipped) -> None:
    """Log each distinct skip once. In auto mode a back-end that is not installed here is the
    normal choice (info); a requested back-end missing, a call it cannot take, or one that
    raised is a fallback the user should see (warning)."""
    for name, reason, kind in skipped:
        key = (requested, name, reason)
        if key in _logged:
            continue
        _logged.add(key)
        quiet = requested == "auto" and kind == "unavailable"
        log.log(logging.INFO if quiet else logging.WARNING,
                "attention back-end %s skipped (%s); %s ran instead (requested: %s)", name, reason, used, requested)


def describe_backends(device=None) -> list[dict]:
    """Every back-end in auto order with whether it can run here and why not."""
    rows = []
    for name in AUTO_ORDER:
        verdict = BACKENDS[name].available()
        if verdict and device is not None and BACKENDS[name].needs_cuda and torch.device(device).type != "cuda":
            verdict_ok, reason = False, f"needs a CUDA device, got {torch.device(device).type}"
        else:
            verdict_ok, reason = verdict.ok, verdict.reason
        rows.append({"name": name, "available": verdict_ok, "reason": reason})
    return rows
