"""The node's settings, validated once, here: the node and both ``patch_model`` functions call
:func:`check_settings`; the kernels keep only their own API-boundary checks."""

from __future__ import annotations

from .. import kernels

NODE = "Sage Strided NHD Attention"


def check_settings(layout: str, backend: str, prep_mode: str = "exact") -> None:
    """Raise ``ValueError`` naming the bad value and the valid ones."""
    for what, value, valid in (("layout", layout, kernels.LAYOUTS),
                               ("back-end", backend, kernels.BACKEND_CHOICES),
                               ("sage2_prep mode", prep_mode, kernels.PREP_MODES)):
        if value not in valid:
            raise ValueError(f"{NODE}: unknown {what} {value!r}; choose one of {', '.join(valid)}")
