"""The contract every attention back-end follows, and the optional prepared-path capability; reasons are data."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..gpu import exact_device

INT32_MAX_OFFSET = 2**31 - 1

# How a back-end is handed q/k/v, [B, S, H, D] or [B, H, S, D]; not the dataflow's layouts (kernels.LAYOUTS).
TENSOR_LAYOUTS = ("NHD", "HND")


# Why a back-end did not take a call: code -> the UI's label (web/report_text.js keeps the same table).
REASON_CODES = {
    "not_installed": "not installed", "wrong_version": "other version installed",
    "no_cuda": "needs CUDA", "gpu_arch": "no kernel for this GPU",
    "gpu_unavailable": "unavailable on this GPU", "dtype": "dtype unsupported",
    "head_dim": "head_dim unsupported", "mask": "no mask support",
    "strides": "needs contiguous last dim", "shape": "shape unsupported",
    "too_long": "sequence too long",
    "raised": "raised an error", "switched_off": "switched off", "mode": "mode not offered",
    "model_request": "model asked for stock attention",
    "no_backend": "no back-end could run", "self_test_failed": "failed its self-test",
}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""
    code: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Verdict(True)


def no(code: str, reason: str) -> Verdict:
    assert code in REASON_CODES, f"unknown reason code {code!r}"  # a programming error, caught by the tests
    return Verdict(False, reason, code)


@dataclass(frozen=True)
class Prepared:
    """One call's operands in a back-end's own format; the q/k/v views and their buffer may be freed."""

    backend: str
    mode: str                         # the preparation mode that ran
    operands: dict                    # name -> tensor, the back-end's own layout
    sm_scale: float
    out_dtype: torch.dtype
    seq: int
    heads: int
    head_dim: int
    head_chunks: tuple = ((0, 0),)    # (first head, end head) per kernel launch
    projected_chunks: int = 0         # token chunks of a projection taken by rows (0: handed whole)


class AttentionBackend:
    """Base class: subclasses declare capabilities as class attributes (``max_element_offset`` None: 64-bit). A
    non-empty ``prepared_modes`` declares the optional prepared path (``prepared_verdict``, ``prepare``, ``attend``;
    ``prepares_projected`` adds ``prepare_projected``), documented by ``Sage2Backend``."""

    name: str = ""
    max_element_offset: int | None = None
    row_block: int = 1
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: tuple[int, ...] | None = None  # None: any
    max_head_dim: int | None = None
    needs_cuda: bool = True
    takes_mask: bool = False
    prepared_modes: tuple[str, ...] = ()
    prepares_projected: bool = False
    compile_events: tuple | list = ()

    @functools.cached_property
    def _availability(self) -> Verdict:
        return self._check_available()

    def available(self, device=None) -> Verdict:
        """Can this back-end run in this process (checked once), and on ``device`` when given?"""
        verdict = self._availability
        return self.device_verdict(device) if verdict and device is not None else verdict

    def _check_available(self) -> Verdict:
        raise NotImplementedError

    def device_verdict(self, device) -> Verdict:
        """Is this back-end trusted on ``device``? Checked once per process and device (``_check_device``)."""
        device = exact_device(device)
        verdicts = self.__dict__.setdefault("_device_verdicts", {})
        if str(device) not in verdicts:
            verdicts[str(device)] = self._check_device(device)
        return verdicts[str(device)]

    def _check_device(self, device: torch.device) -> Verdict:
        return YES

    def supports(self, q, k, v, *, layout: str, mask=None) -> Verdict:
        """Can it take this call? Shared rules first, then the back-end's own."""
        if self.needs_cuda and q.device.type != "cuda":
            return no("no_cuda", f"needs a CUDA device, got {q.device.type}")
        if q.dtype not in self.dtypes:
            return no("dtype", f"dtype {q.dtype} not in {[str(d) for d in self.dtypes]}")
        if not (q.dtype == k.dtype == v.dtype):
            return no("dtype", "q, k and v dtypes differ")
        head_dim = q.shape[-1]
        if self.head_dims is not None and head_dim not in self.head_dims:
            return no("head_dim", f"head_dim {head_dim} not in {list(self.head_dims)}")
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return no("head_dim", f"head_dim {head_dim} > {self.max_head_dim}")
        if mask is not None and not self.takes_mask:
            return no("mask", "attention masks are not supported")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            return no("strides", "last dim of q, k, v must be contiguous")
        verdict = self._supports(q, k, v, layout=layout, mask=mask)
        return self.device_verdict(q.device) if verdict else verdict

    def _supports(self, q, k, v, *, layout: str, mask=None) -> Verdict:
        return YES

    def __call__(self, q, k, v, *, layout: str, scale: float | None = None, mask=None) -> torch.Tensor:
        """Attention in ``layout`` ("NHD" [B,S,H,D] or "HND" [B,H,S,D]); output in the same layout."""
        raise NotImplementedError

