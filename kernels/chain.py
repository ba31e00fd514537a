"""The back-end chain: per call, the first back-end available for and supporting it runs it (its prepared path
when asked for and allowed, else its plain call); one that raises is skipped; every skip is recorded."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .backends import AUTO_ORDER, BACKENDS, AttentionBackend
from .backends.base import TENSOR_LAYOUTS
from .offsets import fits, heads_per_chunk

log = logging.getLogger("sage_strided_nhd")

BACKEND_CHOICES = ("auto",) + tuple(sorted(BACKENDS, key=AUTO_ORDER.index))

_logged: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Skip:
    """A back-end or prepared path passed over: ``code`` in REASON_CODES, ``kind`` unavailable/unsupported/raised."""

    backend: str
    code: str
    reason: str
    kind: str


@dataclass
class CallRecord:
    """What one attention call did. Every field is observed during the call, none is assumed."""

    requested: str
    backend: str = ""
    layout: str = ""                    # the dataflow's layout ("strided_nhd" | "hnd"), set by the dataflow
    skipped: tuple[Skip, ...] = ()
    head_chunks: int = 1
    compacted: bool = False             # inputs copied into compact head chunks to keep int32 offsets in range
    copies: int = 0                     # tensor copies the pack's dataflow made for this call
    prepared: str = ""                  # the prepared path's mode, when it ran
    prepared_skipped: Skip | None = None  # why the back-end that ran did not take its prepared path
    projected_chunks: int = 0           # the qkv projection came in this many token chunks (0: whole)
    compiled: tuple[dict, ...] = ()     # JIT compiles this call triggered: {"backend", "key", "seconds"}

    def fell_back(self, skip: Skip) -> bool:
        """``skip`` is a fallback: the back-end asked for could not run the call. Others were only passed over."""
        return asked_for(self.requested, skip)


def asked_for(requested: str, skip: Skip) -> bool:
    """A named choice (the node's, or a checkpoint's preference under auto) asks for that back-end alone. ``auto``
    asks for the fastest one here: passing over one it lacks is normal; one that cannot take the call is a fallback."""
    if requested == "auto":
        return skip.kind != "unavailable"
    return skip.backend == requested


class NoBackendError(RuntimeError):
    """No back-end in the chain could take the call; the message lists every back-end's reason."""

    def __init__(self, skipped):
        self.skipped = tuple(skipped)
        super().__init__("no attention back-end could run this call ("
                         + "; ".join(f"{s.backend}: {s.reason}" for s in self.skipped) + ")")


@dataclass(frozen=True)
class BackendChain:
    """The back-ends one call may use, in order. ``prepared=False`` switches every prepared path off."""

    requested: str
    backends: tuple[AttentionBackend, ...] = ()
    prepared: bool = True

    @classmethod
    def for_choice(cls, choice: str, *, prepared: bool = True) -> "BackendChain":
        """``auto``: every back-end, fastest first. A named back-end: it first, then the rest as fallbacks."""
        if choice not in BACKEND_CHOICES:
            raise ValueError(f"unknown attention back-end {choice!r}; choose one of {', '.join(BACKEND_CHOICES)}")
        order = sorted(AUTO_ORDER, key=lambda name: name != choice)  # stable: the rest keep AUTO_ORDER
        return cls(choice, tuple(BACKENDS[name] for name in order), prepared)

    def run(self, q, k, v, **kwargs):
        """Attention on q, k, v (keywords of ``run_handed``); returns (output, CallRecord)."""
        return self.run_handed([q, k, v], **kwargs)

    def run_handed(self, views: list, *, layout: str, scale: float | None = None, mask=None, norm=None,
                   prepared_mode: str | None = None):
        """``run`` on ``views = [q, k, v]``, emptied so a prepared path can free them; ``norm``: still owed."""
        if layout not in TENSOR_LAYOUTS:
            raise ValueError(f"tensor layout must be one of {TENSOR_LAYOUTS}, got {layout!r}")
        _check_shapes(*views)
        skipped: list[Skip] = []
        for backend in self._candidates(views, layout, mask, skipped):
            seen = len(backend.compile_events)
            no_prepared = None
            if backend.prepared_modes and prepared_mode is not None and layout == "NHD" and mask is None:
                out, done = self._run_prepared(backend, views, prepared_mode, scale, norm)
                if out is not None:
                    return out, self._record(backend, skipped, seen, prepared=done.mode,
                                             head_chunks=len(done.head_chunks))
                no_prepared = done
            if norm is not None:
                views[0], views[1] = norm.apply(views[0], views[1])
            try:
                out, chunks, compacted = _run_within_offsets(backend, *views, layout, scale, mask)
            except torch.cuda.OutOfMemoryError:
                raise  # a smaller back-end won't help the caller more than a clear OOM
            except Exception as exc:
                raised = _raised(backend, exc)
                skipped += [s for s in (no_prepared,) if s is not None and s.kind == "raised"] + [raised]
                continue
            views.clear()
            # compacting copies 3 inputs and 1 output per chunk
            return out, self._record(backend, skipped, seen, head_chunks=chunks, compacted=compacted,
                                     copies=4 * chunks if compacted else 0, prepared_skipped=no_prepared)
        raise NoBackendError(skipped)

    def run_projected(self, projection, heads: int, head_dim: int, *, norm, prepared_mode: str, chunk: int,
                      scale: float | None = None):
        """The prepared path on a projection by token chunks, or (None, None): the caller projects whole."""
        if not self.prepared or not norm.by_rows:
            return None, None
        if projection.k is not None:  # K projected ahead: Q and V will be its shape, dtype and place
            kv, views = None, [projection.k.view(1, projection.seq, heads, head_dim)] * 3
        else:  # whole rows by chunks: a buffer for K/V
            kv = torch.empty(projection.seq, 2 * heads * head_dim, dtype=projection.dtype, device=projection.device)
            views = [*kv.unflatten(1, (2, heads, head_dim)).unsqueeze(0).unbind(2)]
            views.insert(0, views[0])  # q is k's shape, dtype and place
        skipped: list[Skip] = []
        # the first back-end that takes the call at all, if it offers this path in this mode
        backend = next(self._candidates(views, "NHD", None, skipped), None)
        if backend is not None and not (backend.prepares_projected and prepared_mode in backend.prepared_modes
                                        and backend.prepared_verdict(*views)):
            backend = None
        views.clear()  # emptied before the preparation, which frees K first
        if backend is None:
            return None, None  # the call runs as run_handed runs it
        seen = len(backend.compile_events)
        try:
            prepared = backend.prepare_projected(projection, kv, heads=heads, mode=prepared_mode, scale=scale,
                                                 norm=norm, chunk=chunk)
        except Exception as exc:
            raised = _raised(backend, exc, "prepared path on a projection by token chunks ")
            if projection.released:
                raise  # its input is gone: the projection cannot be taken whole for a fallback
            projection.k = None  # K taken ahead may be normalised in part: the fallback projects anew
            _log_skips(self.requested, backend.name, [raised])
            return None, None
        del kv  # K and V are in the operands now
        return backend.attend(prepared), self._record(
            backend, skipped, seen, prepared=prepared.mode, head_chunks=len(prepared.head_chunks),
            projected_chunks=prepared.projected_chunks)

    def _candidates(self, views: list, layout: str, mask, skipped: list):
        """The back-ends, in order, that take the call on ``views`` (read anew: a norm may replace Q/K)."""
        for backend in self.backends:
            verdict, kind = backend.available(), "unavailable"
            if verdict:
                verdict, kind = backend.supports(*views, layout=layout, mask=mask), "unsupported"
            if verdict:
                yield backend
            else:
                skipped.append(Skip(backend.name, verdict.code, verdict.reason, kind))

    def _run_prepared(self, backend, views: list, mode: str, scale, norm):
        """(output, Prepared) or (None, Skip). ``views`` is emptied before the kernel: its error has no fallback."""
        if not self.prepared:
            return None, Skip(backend.name, "switched_off", f"{backend.name} prepared path switched off", "unsupported")
        if mode not in backend.prepared_modes:
            return None, Skip(backend.name, "mode", f"{backend.name} has no prepared mode {mode!r}", "unsupported")
        verdict = backend.prepared_verdict(*views)
        if not verdict:
            return None, Skip(backend.name, verdict.code, verdict.reason, "unsupported")
        if norm is not None:  # applied here, once: a fallback after a failed preparation sees it done
            views[0], views[1] = norm.apply(views[0], views[1])
        try:
            prepared = backend.prepare(*views, mode=mode, scale=scale)
        except Exception as exc:
            return None, _raised(backend, exc, "prepared path ")
        views.clear()  # nothing reads the views now: the kernel's working set replaces them
        return backend.attend(prepared), prepared

    def _record(self, backend, skipped, compiles_seen: int, **fields) -> CallRecord:
        """The CallRecord of a call that ``backend`` took after ``skipped``; logs new skips once."""
        extra = [fields["prepared_skipped"]] if fields.get("prepared_skipped") else []
        _log_skips(self.requested, backend.name, skipped + [s for s in extra if s.kind == "raised"])
        compiled = tuple(dict(e, backend=backend.name) for e in backend.compile_events[compiles_seen:])
        return CallRecord(self.requested, backend=backend.name, skipped=tuple(skipped), compiled=compiled, **fields)


def _check_shapes(q, k, v):
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(f"q, k, v must be 4-D, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _raised(backend: AttentionBackend, exc: Exception, what: str = "") -> Skip:
    # an illegal access poisons the CUDA context: a fallback would only hide where it broke
    if "illegal memory access" in str(exc) or "device-side assert" in str(exc):
        raise exc
    return Skip(backend.name, "raised", f"{what}raised {type(exc).__name__}: {exc}", "raised")


def _run_within_offsets(backend: AttentionBackend, q, k, v, layout, scale, mask):
    """(output, head chunks, compacted): direct, or on compact head-chunk copies where int32 would overflow."""
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
    out, starts = None, range(0, heads, per_chunk)
    for start in starts:
        n = min(per_chunk, heads - start)
        o = backend(*(t.narrow(head_dim_index, start, n).contiguous() for t in (q, k, v)), layout=layout, scale=scale)
        if out is None:
            out = torch.empty(list(q.shape), dtype=o.dtype, device=o.device)
        out.narrow(head_dim_index, start, n).copy_(o)
    return out, len(starts), True


def _log_skips(requested: str, used: str, skipped) -> None:
    """Log each distinct skip once: a warning for a fallback or a back-end that raised, else info."""
    for s in skipped:
        key = (requested, s.backend, s.reason)
        if key in _logged:
            continue
        _logged.add(key)
        quiet = not asked_for(requested, s) and s.kind != "raised"
        log.log(logging.INFO if quiet else logging.WARNING,
                "[Sage Strided NHD] attention back-end %s skipped (%s); %s ran instead (requested: %s)",
                s.backend, s.reason, used, requested)
