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
from .backends.base import TENSOR_LAYOUTS
from .offsets import fits, heads_per_chunk

log = logging.getLogger("sage_strided_nhd")

BACKEND_CHOICES = ("auto",) + tuple(sorted(BACKENDS, key=AUTO_ORDER.index))

_logged: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Skip:
    """A back-end the chain passed over for one call, and why.

    ``kind``: ``unavailable`` (cannot run on this machine at all: not installed, no CUDA, no kernel
    for this GPU), ``unsupported`` (cannot take this particular call: dtype, head size, mask, device)
    or ``raised`` (it was tried and raised).
    """

    backend: str
    reason: str
    kind: str


@dataclass
class CallRecord:
    """What one attention call did. Every field is observed during the call, none is assumed."""

    requested: str
    backend: str = ""
    layout: str = ""                # the dataflow's layout ("strided_nhd" | "hnd"), set by the dataflow
    skipped: tuple[Skip, ...] = ()
    head_chunks: int = 1
    compacted: bool = False         # inputs copied into compact head chunks to keep int32 offsets in range
    copies: int = 0                 # tensor copies the pack's dataflow made for this call
    fast_path: str = ""             # the back-end's own prepared-operand path, when it ran
    fast_path_skipped: str = ""     # why no fast path ran, when the chain looked for one
    compiled: tuple[dict, ...] = ()  # JIT compiles this call triggered: {"backend", "key", "seconds"}

    @property
    def fallbacks(self) -> tuple[tuple[str, str], ...]:
        return tuple((s.backend, s.reason) for s in self.skipped)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["skipped"] = [asdict(s) for s in self.skipped]
        d["compiled"] = list(self.compiled)
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

    def candidates(self, q, k, v, *, layout: str, mask=None):
        """Yield (back-end, skips so far) for each back-end that says it can take this call."""
        if layout not in TENSOR_LAYOUTS:
            raise ValueError(f"tensor layout must be one of {TENSOR_LAYOUTS}, got {layout!r}")
        _check_shapes(q, k, v)
        skipped: list[Skip] = []
        for backend in self.backends:
            verdict = backend.available()
            kind = "unavailable"
            if verdict:
                verdict, kind = backend.supports(q, k, v, layout=layout, mask=mask), "unsupported"
            if not verdict:
                skipped.append(Skip(backend.name, verdict.reason, kind))
                continue
            yield backend, skipped

    def fast_path(self, q, k, v, *, layout: str):
        """The back-end that would take this unmasked call, when it offers a prepared-operand fast path.

        Returns (back-end or None, skips before it, why there is no fast path). A back-end with a
        fast path has ``fast_path_verdict``, ``prepare`` and ``attend`` (see backends/sage2.py).
        """
        for backend, skipped in self.candidates(q, k, v, layout=layout):
            check = getattr(backend, "fast_path_verdict", None)
            if check is None:
                return None, skipped, ""  # nothing to report: this back-end has no fast path at all
            if not getattr(backend, "fast_path_enabled", True):
                return None, skipped, f"{backend.name} fast path switched off"
            verdict = check(q, k, v, layout=layout)
            if not verdict:
                return None, skipped, f"{backend.name} fast path: {verdict.reason}"
            return backend, list(skipped), ""
        return None, [], "no back-end can take this call"

    def run(self, q, k, v, *, layout: str, scale: float | None = None, mask=None):
        """Attention on q, k, v in tensor layout ``layout`` ("NHD" | "HND"); returns (output, CallRecord)."""
        skipped: list[Skip] = []
        for backend, skipped in self.candidates(q, k, v, layout=layout, mask=mask):
            events = getattr(backend, "compile_events", None)
            seen = len(events) if events is not None else 0
            try:
                out, chunks, compacted = _run_within_offsets(backend, q, k, v, layout, scale, mask)
            except torch.cuda.OutOfMemoryError:
                raise  # a smaller back-end won't help the caller more than a clear OOM
            except Exception as exc:
                raise_if_context_lost(exc)
                skipped.append(Skip(backend.name, f"raised {type(exc).__name__}: {exc}", "raised"))
                continue
            record = self.record(backend, skipped, head_chunks=chunks, compacted=compacted)
            record.copies = 4 * chunks if compacted else 0  # 3 compact inputs + 1 output copy per chunk
            if events is not None and len(events) > seen:
                record.compiled = tuple(dict(e, backend=backend.name) for e in events[seen:])
            return out, record
        raise NoBackendError("no attention back-end could run this call ("
                             + "; ".join(f"{s.backend}: {s.reason}" for s in skipped) + ")")

    def record(self, backend, skipped, **fields) -> CallRecord:
        """The CallRecord of a call that ``backend`` took after ``skipped``; logs new skips once."""
        _log_skips(self.requested, backend.name, skipped)
        return CallRecord(self.requested, backend=backend.name, skipped=tuple(skipped), **fields)


def _check_shapes(q, k, v):
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(f"q, k, v must be 4-D, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def raise_if_context_lost(exc: Exception) -> None:
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


def _log_skips(requested: str, used: str, skipped) -> None:
    """Log each distinct skip once. In auto mode a back-end that is not installed here is the
    normal choice (info); a requested back-end missing, a call it cannot take, or one that
    raised is a fallback the user should see (warning)."""
    for s in skipped:
        key = (requested, s.backend, s.reason)
        if key in _logged:
            continue
        _logged.add(key)
        quiet = requested == "auto" and s.kind == "unavailable"
        log.log(logging.INFO if quiet else logging.WARNING,
                "attention back-end %s skipped (%s); %s ran instead (requested: %s)", s.backend, s.reason, used, requested)


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
