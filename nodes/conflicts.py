"""What the node does when something else also replaces attention on the model it runs.

The node patches a clone; other nodes may patch the same model before it or after it in
the chain. Nodes placed after it cannot be seen when it executes, so the whole stack is
checked again when sampling starts (the OUTER_SAMPLE wrapper of the run report), on the
ModelPatcher and model options actually being sampled. One rule per case, the same in
both orders (the README carries the same list):

1. **This node's own patch twice** (the node applied twice in a chain): the patch nearest
   the sampler *replaces* the earlier one and the report says so (``replaced_own_patch``).
2. **Another node's object patch of an H3 ``...attn.forward`` this node patches**: *refuse*
   (:class:`PatchConflictError` naming the keys and the owner). Both replace the whole
   forward, so one would silently drop the other.
3. **Another node's ``optimized_attention_override``** ("Patch Sage Attention", core
   "Model Attention Backend", ...):
   - H3 path: *refuse*. The patched forwards do not call ``optimized_attention``, so the
     other override would silently get no calls.
   - override path (Wan, ...): *refuse* when it replaced this node's override; *compose*
     when it wraps this node's override (holds it as the attention it falls back to, as
     chaining overrides do): it runs first, the calls it declines come here, and the
     report notes it.
4. **Core "Model Sparse Attention"** (``BlockSparseAttention``, recognised by its
   ``block_sparse_attention`` ON_PREPARE_STATE callback): *compose*, either order. Its
   override chains the attention before it and reinstalls itself on top every step; on
   H3 its block replaces pass their own ``attention=`` to the blocks for the calls it
   makes sparse, and everything else (dense steps, ``dense_blocks``, the text refiner)
   runs this node's forward, i.e. this node is its dense attention. Its sparse calls are
   not counted here; the report notes the composition. An override it chains that is
   neither this node's nor its own falls under rule 3.
5. **Block replaces** (``patches_replace["dit"]``) from other nodes on H3: *compose*. Calls
   they route to the block's ``attn`` run this node's forward and are counted; calls they
   route elsewhere are theirs; the report notes how many blocks carry them.
6. **The checkpoint's attention preference** (current ComfyUI: ``<attn>.comfy_attention``
   with ``config`` such as ``{"attention": "comfy_kitchen_int8"}``): with ``backend = auto``
   the pack *honours* it per module, running the preferred back-end first in the strided
   NHD dataflow; an explicit back-end on the node *overrides* it. Either way the report
   notes it per block family. A preference naming an attention the pack has no back-end
   for is ignored with a note (as ComfyUI ignores unsupported ones).
7. **Another node's object patch of ``...attn.comfy_attention.function``** (or a
   ``function`` set without ``config``): a known ComfyUI attention function
   (``attention_comfy_kitchen_int8``, ``attention_pytorch``, ``attention_sage``) is taken
   as that module's preference (rule 6); any other function is *refused*, because this
   node's forward does not call it.

Ownership is recognised by the ``sage_strided_nhd`` attribute this pack sets on every
callable it installs.
"""

from __future__ import annotations

OWN_MARK = "sage_strided_nhd"
SPARSE_CALLBACK_KEY = "block_sparse_attention"   # core Model Sparse Attention's ON_PREPARE_STATE key
SPARSE_OVERRIDE_QUALNAME = "make_attention_override.<locals>.override"
ON_PREPARE_STATE = "on_prepare_state"            # comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE


class PatchConflictError(RuntimeError):
    """The model carries another node's patch on what this node replaces."""


def is_own(obj) -> bool:
    return bool(getattr(obj, OWN_MARK, False))


def existing_override(model_options):
    return model_options.get("transformer_options", {}).get("optimized_attention_override")


def describe(obj) -> str:
    fn = getattr(obj, "__func__", obj)
    module = getattr(fn, "__module__", None) or type(obj).__module__
    name = getattr(fn, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"


def sparse_node_present(model_patcher) -> bool:
    callbacks = getattr(model_patcher, "callbacks", {}) or {}
    return SPARSE_CALLBACK_KEY in callbacks.get(ON_PREPARE_STATE, {})


def _is_sparse_override(fn, sparse_present: bool) -> bool:
    return sparse_present and getattr(fn, "__qualname__", "").endswith(SPARSE_OVERRIDE_QUALNAME)


def wrapped_attention(fn, depth: int = 0) -> list:
    """Callables ``fn`` holds as the attention it falls back to (closure cells, ``previous``,
    ``__wrapped__``, partials), outermost first. Best effort: what cannot be seen is not listed."""
    if fn is None or depth > 8:
        return []
    found = []
    inner = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # empty cell
            continue
    for name in ("previous", "__wrapped__", "func"):
        inner.append(getattr(fn, name, None))
    for obj in inner:
        if callable(obj) and not isinstance(obj, type) and (is_own(obj) or getattr(obj, "__closure__", None)
                                                            or hasattr(obj, "previous")):
            if any(obj is f for f in found):
                continue
            found.append(obj)
            if not is_own(obj):
                found.extend(wrapped_attention(obj, depth + 1))
    return found


def _override_error(other, how: str) -> PatchConflictError:
    return PatchConflictError(
        f"Sage Strided NHD Attention: another node's attention override ({describe(other)}) {how}. Both cannot "
        "run: remove the other attention node (e.g. 'Patch Sage Attention', 'Model Attention Backend') from this "
        "model's chain, or remove this one.")


def check_override_at_patch(model_patcher, path: str) -> bool:
    """Rules 1, 3, 4 when the node executes. True when the existing override is this pack's own."""
    current = existing_override(model_patcher.model_options)
    if current is None:
        return False
    if is_own(current):
        return True
    sparse = sparse_node_present(model_patcher)
    for fn in [current] + wrapped_attention(current):
        if is_own(fn) or _is_sparse_override(fn, sparse):
            continue
        if path == "h3_forward_patch":
            raise _override_error(fn, "is on this model; this node's H3 forwards do not call optimized_attention, "
                                      "so it would silently stop running")
        raise _override_error(fn, "is already on this model and this node would replace it")
    return False


def check_override_at_sampling(model_patcher, model_options, path: str, ours=None) -> list[str]:
    """Rules 3 and 4 on the model being sampled; returns notes, raises PatchConflictError."""
    notes = []
    sparse = sparse_node_present(model_patcher)
    if sparse:
        if path == "h3_forward_patch":
            notes.append("composed with Model Sparse Attention: its sparse calls run its own attention (block-level "
                         "attention=) and are not counted here; its dense calls run this node's forward")
        else:
            notes.append("composed with Model Sparse Attention: its override runs first and hands this node the "
                         "calls it keeps dense")
    current = existing_override(model_options)
    if current is None:
        if path == "attention_override":
            notes.append("this node's attention override is not on the model being sampled: nothing ran through it")
        return notes
    chain = [current] + wrapped_attention(current)
    if path == "h3_forward_patch":
        for fn in chain:
            if not (is_own(fn) or _is_sparse_override(fn, sparse)):
                raise _override_error(fn, "was added to this model; this node's H3 forwards do not call "
                                          "optimized_attention, so it would silently get no calls")
        return notes
    if current is ours:
        return notes
    if not any(fn is ours for fn in chain):
        raise _override_error(current, "replaced this node's override (it was added after this node)")
    for fn in chain:
        if fn is ours:
            break
        if not _is_sparse_override(fn, sparse):
            notes.append(f"composed with another node's attention override ({describe(fn)}): it runs first and "
                         "hands this node the calls it declines")
    return notes


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
        raise forward_conflict(model_patcher, foreign, "already replaced")
    return own


def forward_conflict(model_patcher, foreign: list[str], how: str) -> PatchConflictError:
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    return PatchConflictError(
        f"Sage Strided NHD Attention: another node {how} {len(foreign)} attention forward(s) "
        f"this node patches ({shown}; first by {describe(model_patcher.object_patches[foreign[0]])}). "
        "Only one patch can own a forward: remove the other H3 attention patch node from this model's chain, "
        "or remove this one.")
