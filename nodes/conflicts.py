"""What the node does when the model already carries attention patches.

The rules (also in the README):

1. **This node's own patch** (the node applied twice in a chain): the earlier patch is
   *replaced* by the new settings, and the report says so (``replaced_own_patch``).
   Two layers of the same patch cannot both run, and the node nearest the sampler is
   the one the user sees, so it wins.
2. **Another pack's object patch on a forward this node would patch** (H3
   ``blocks.{i}.attn.forward``): *refuse* with :class:`PatchConflictError` naming the
   patched keys. Replacing it would silently drop that pack's behaviour; wrapping it is
   impossible because both replace the whole forward.
3. **Another pack's ``optimized_attention_override``** (either path): *refuse*. On the
   override path both want to be the one attention function; on the H3 path the
   patched forwards no longer call ``optimized_attention``, so the other override would
   silently stop working.

Ownership is recognised by the ``sage_strided_nhd`` attribute this pack sets on
every callable it installs.
"""

from __future__ import annotations

OWN_MARK = "sage_strided_nhd"


class PatchConflictError(RuntimeError):
    """The model already carries another pack's patch on what this node would replace."""


def is_own(obj) -> bool:
    return bool(getattr(obj, OWN_MARK, False))


def existing_override(model_patcher):
    return model_patcher.model_options.get("transformer_options", {}).get("optimized_attention_override")


def _describe(obj) -> str:
    fn = getattr(obj, "__func__", obj)
    module = getattr(fn, "__module__", None) or type(obj).__module__
    name = getattr(fn, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"


def check_override(model_patcher) -> bool:
    """Rule 3. Returns True when the existing override is this pack's own (rule 1)."""
    current = existing_override(model_patcher)
    if current is None:
        return False
    if is_own(current):
        return True
    raise PatchConflictError(
        "Sage Strided NHD Attention: this model already has an attention override from another node "
        f"({_describe(current)}). Both cannot run: remove the other attention node (e.g. a 'Patch Sage "
        "Attention' node) from this model's chain, or remove this one.")


def check_object_patches(model_patcher, keys) -> bool:
    """Rule 2 for the object-patch keys this node would set. True when any is our own (rule 1)."""
    foreign, own = [], False
    for key in keys:
        obj = model_patcher.object_patches.get(key)
        if obj is None:
            continue
        if is_own(obj):
            own = True
        else:
            foreign.append(key)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise PatchConflictError(
            f"Sage Strided NHD Attention: another node already replaced {len(foreign)} attention forward(s) "
            f"this node patches ({shown}; first by {_describe(model_patcher.object_patches[foreign[0]])}). "
            "Only one patch can own a forward: remove the other H3 attention patch node from this model's chain, "
            "or remove this one.")
    return own
