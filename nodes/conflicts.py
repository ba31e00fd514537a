"""The stack rules (1-10, written out in docs/ARCHITECTURE.md), checked when the node executes and again when
sampling starts (:func:`plan_h3`, :func:`plan_override`: the run's Plan, or PatchConflictError)."""

from __future__ import annotations

import itertools
import types
from collections import Counter
from dataclasses import dataclass, field

from .. import kernels
from .ownership import describe, is_foreign, is_own, plain_function, replaced_forward
from .patch import NODE, Note, Plan

SPARSE_CALLBACK_KEY = "block_sparse_attention"   # core Model Sparse Attention's ON_PREPARE_STATE key
SPARSE_OVERRIDE_QUALNAME = "make_attention_override.<locals>.override"
# Forwards of other packs that compute stock's result (attention: rule 8, block: rule 9): this node takes their place
STOCK_EQUAL_FORWARDS = {"minimax_attn_lowmem_forward": "KJNodes' MiniMax H3 Low VRAM Attention"}
STOCK_EQUAL_BLOCK_FORWARDS = {"minimax_block_lowmem_forward": "KJNodes' MiniMax H3 Low VRAM Attention"}
# Rule 10: loaders that run the model's forward themselves, by a class, function or module name they leave on it
FORWARD_TAKERS = {"SGLDiffusionExecutor": "SGLang Diffusion's integrated mode", "raylight": "Raylight",
                  "MiniMaxH3SPUNETLoader": "the MiniMax H3 Multi-GPU Loader (Ulysses SP)"}
UNKNOWN_TAKER = "another loader or node"
EMPTY_CELL = types.CellType()  # an unset closure cell equals it (a set one is never compared by its contents)
H3_MODULE = "comfy.ldm.minimax.model"


class PatchConflictError(RuntimeError):
    """The model carries another node's patch on what this node replaces."""


def sparse_node_present(model_patcher) -> bool:  # "on_prepare_state": CallbacksMP.ON_PREPARE_STATE
    return SPARSE_CALLBACK_KEY in (getattr(model_patcher, "callbacks", {}) or {}).get("on_prepare_state", {})


def _is_sparse_override(fn, sparse_present: bool) -> bool:
    return sparse_present and getattr(fn, "__qualname__", "").endswith(SPARSE_OVERRIDE_QUALNAME)


def wrapped_attention(fn, depth: int = 0) -> list:
    """Callables ``fn`` holds as the attention it falls back to (closure cells, ``previous``,
    ``__wrapped__``, partials), outermost first. Best effort: what cannot be seen is not listed."""
    if fn is None or depth > 8:
        return []
    cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if c != EMPTY_CELL]
    found = []
    for obj in cells + [getattr(fn, name, None) for name in ("previous", "__wrapped__", "func")]:
        wraps = is_own(obj) or getattr(obj, "__closure__", None) or hasattr(obj, "previous")
        if callable(obj) and not isinstance(obj, type) and wraps and not any(obj is f for f in found):
            found.append(obj)
            if not is_own(obj):
                found.extend(wrapped_attention(obj, depth + 1))
    return found


# Rules 3 and 4: what another node's override (not this pack's, not Model Sparse Attention's) does to this node
NO_OVERRIDE_CALL = "this node's H3 forwards do not call optimized_attention, so it would silently"
FOREIGN_OVERRIDE = {("h3_forward_patch", "patch"): f"is on this model; {NO_OVERRIDE_CALL} stop running",
                    ("attention_override", "patch"): "is already on this model and this node would replace it",
                    ("h3_forward_patch", "sampling"): f"was added to this model; {NO_OVERRIDE_CALL} get no calls"}


def _refuse_foreign_override(current, sparse: bool, path: str, when: str) -> None:
    for fn in [current] + wrapped_attention(current):
        if not (is_own(fn) or _is_sparse_override(fn, sparse)):
            raise _override_error(fn, FOREIGN_OVERRIDE[path, when])


def _override_error(other, how: str) -> PatchConflictError:
    return PatchConflictError(
        f"{NODE}: another node's attention override ({describe(other)}) {how}. Both cannot "
        "run: remove the other attention node (e.g. 'Patch Sage Attention', 'Model Attention Backend') from this "
        "model's chain, or remove this one.")


def check_override_at_patch(model_patcher, path: str) -> bool:
    """Rules 1, 3, 4 when the node executes. True when the existing override is this pack's own."""
    current = model_patcher.model_options.get("transformer_options", {}).get("optimized_attention_override")
    if current is not None and not is_own(current):
        _refuse_foreign_override(current, sparse_node_present(model_patcher), path, "patch")
    return is_own(current)


def check_override_at_sampling(model_patcher, model_options, path: str, ours=None) -> list[Note]:
    """Rules 3 and 4 on the model being sampled; returns notes, raises PatchConflictError."""
    notes = []
    sparse = sparse_node_present(model_patcher)
    if sparse:
        how = ("its override runs first and hands this node the calls it keeps dense" if path == "attention_override"
               else "its sparse calls run its own attention (block-level attention=) and are not counted here; its "
                    "dense calls run this node's forward")
        notes.append(Note("sparse_composed", f"composed with Model Sparse Attention: {how}"))
    current = model_options.get("transformer_options", {}).get("optimized_attention_override")
    if current is None:
        if path == "attention_override":
            notes.append(Note("override_missing", "this node's attention override is not on the model being "
                                                  "sampled: nothing ran through it"))
        return notes
    if path == "h3_forward_patch":
        _refuse_foreign_override(current, sparse, path, "sampling")
        return notes
    chain = [current] + wrapped_attention(current)
    if not any(fn is ours for fn in chain):
        raise _override_error(current, "replaced this node's override (it was added after this node)")
    for fn in chain[:next(i for i, fn in enumerate(chain) if fn is ours)]:
        if not _is_sparse_override(fn, sparse):
            notes.append(Note("override_composed", f"composed with another node's attention override ({describe(fn)}): "
                                                   "it runs first and hands this node the calls it declines"))
    return notes


def _stock_equal(patches, keys, known: dict, mark: str | None = None) -> dict[str, str]:
    """key -> node of each forward of another pack in ``known`` (by name; carrying ``mark``)."""
    fns = {key: plain_function(patches.get(key)) for key in keys}
    return {key: known[fn.__name__] for key, fn in fns.items()
            if getattr(fn, "__name__", None) in known and (mark is None or getattr(fn, mark, 0))}


def check_object_patches(model_patcher, keys) -> tuple[bool, dict[str, str]]:
    """Rules 1, 2, 8 for the attention forwards this node would set: (any is our own, the stock-equal forwards it
    takes over); another node's forward is refused."""
    patches = model_patcher.object_patches
    taken_over = _stock_equal(patches, keys, STOCK_EQUAL_FORWARDS, "_uses_optimized_attention")
    foreign = [key for key in keys if is_foreign(patches.get(key)) and key not in taken_over]
    if foreign:
        raise forward_conflict(model_patcher, foreign, "already replaced")
    return any(is_own(patches.get(key)) for key in keys), taken_over


def forward_conflict(model_patcher, foreign: list[str], how: str) -> PatchConflictError:
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    return PatchConflictError(
        f"{NODE}: another node {how} {len(foreign)} attention forward(s) this node patches ({shown}; first by "
        f"{describe(model_patcher.object_patches[foreign[0]])}). Only one patch can own a forward: remove the other "
        "H3 attention patch node from this model's chain, or remove this one.")


# --- rules 6 and 7: the checkpoint's attention preference ----------------------------------------
# comfy_attention.config["attention"] names (ComfyUI's) -> the pack's back-end that runs them
PREFERENCE_BACKENDS = {"comfy_kitchen_int8": "comfy_kitchen_int8", "sdpa": "sdpa", "pytorch": "sdpa",
                       "sage": "sage2", "sage2": "sage2", "sage1": "sage1"}
# ComfyUI attention functions another node may set as comfy_attention.function (rule 7)
FUNCTION_BACKENDS = {"attention_comfy_kitchen_int8": "comfy_kitchen_int8", "attention_pytorch": "sdpa",
                     "attention_sage": "sage2"}


def preference(model_patcher, prefix: str):
    """Rule 6: (pack back-end or None, its source, why it is ignored) for one attention module; rule 7 refuses."""
    patched = model_patcher.object_patches.get(prefix + ".comfy_attention.function")
    try:
        cattn = model_patcher.get_model_object(prefix + ".comfy_attention")
    except AttributeError:  # ComfyUI 0.33: no comfy_attention
        cattn = None
    config = getattr(cattn, "config", None)
    function = patched if patched is not None else getattr(cattn, "function", None)
    if patched is None and isinstance(config, dict) and config.get("attention"):
        name = str(config["attention"])
        backend = PREFERENCE_BACKENDS.get(name)
        if backend is None or backend not in kernels.BACKENDS:
            return None, f"comfy_attention.config {name!r}", "the pack has no back-end for it"
        return backend, f"comfy_attention.config {name!r}", None
    if function is None:
        return None, "", None
    backend = FUNCTION_BACKENDS.get(getattr(function, "__name__", ""))
    if backend is None:
        how = "set by another node's object patch" if patched is not None else "set on the module"
        raise PatchConflictError(f"{NODE}: {prefix}.comfy_attention.function is {describe(function)} ({how}). This "
                                 "node's forward does not call it, so it would be silently dropped: remove the node "
                                 "that sets it, or remove this one.")
    return backend, f"comfy_attention.function {describe(function)}", None


def span(indices) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs = [[i for _, i in run] for _, run in itertools.groupby(enumerate(sorted(indices)), lambda n: n[1] - n[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


# --- rule 10: a loader or node that runs the diffusion model's forward itself -----------------------------------
def _taker(obj) -> str:  # the known loader whose class, function or module name ``obj`` carries
    fn = plain_function(obj)
    names = [getattr(fn, "__module__", None) or "", getattr(fn, "__qualname__", "")]
    parts = {part for name in names + [f"{c.__module__}.{c.__qualname__}" for c in type(fn).__mro__]
             for part in name.split(".")}
    return next((who for name, who in FORWARD_TAKERS.items() if name in parts), UNKNOWN_TAKER)


def _is_h3(obj, qualname: str) -> bool:
    return any(c.__module__ == H3_MODULE and c.__qualname__ == qualname for c in type(obj).__mro__)


def h3_base(model_patcher) -> bool:
    """The model is ComfyUI's MiniMax H3 (its BaseModel class), whatever its diffusion model is now."""
    return any(c.__qualname__ == "MiniMaxH3" for c in type(model_patcher.model).__mro__)


def forward_taken_away(model_patcher) -> Note | None:
    """Rule 10: who runs the diffusion model's forward instead (this node's patches unreached), and what shows it."""
    for key in ("diffusion_model.forward", "diffusion_model._forward"):
        if is_foreign(obj := model_patcher.object_patches.get(key)):
            return _taken(obj, f"an object patch of {key}: {describe(obj)}")
    dm = model_patcher.get_model_object("diffusion_model")
    h3 = h3_base(model_patcher)
    if (h3 and not _is_h3(dm, "MiniMaxH3Model")) or _taker(dm) != UNKNOWN_TAKER:
        return _taken(dm, f"the diffusion model is a {describe(type(dm))} object"
                          + (", not ComfyUI's MiniMaxH3Model" if h3 else ""))
    for name in ("forward", "_forward"):
        if replaced_forward(dm, name):
            return _taken(vars(dm)[name], f"diffusion_model.{name} set on the model by {describe(vars(dm)[name])}")
        owner = next((c for c in type(dm).__mro__ if name in vars(c)), None)
        fn = vars(owner)[name] if h3 and owner else None  # set on the class after it was defined
        if fn is not None and getattr(fn, "__qualname__", "") != f"{owner.__qualname__}.{name}":
            return _taken(fn, f"{type(dm).__name__}.{name} replaced on the class by {describe(fn)}")
    blocks = list(getattr(dm, "blocks", ())) if h3 else []
    if other := [b for b in blocks if not _is_h3(b, "DiTBlock")]:
        return _taken(other[0], f"{len(other)} of {len(blocks)} DiT blocks are {describe(type(other[0]))} "
                                "objects, not ComfyUI's DiTBlock")
    return None


def _taken(obj, how: str) -> Note:
    return Note("forward_taken_away", f"{_taker(obj)} runs the model's forward ({how})")


def _preference_plan(model_patcher, keys, backend: str, default):
    """Rule 6 per patched module: (chains that differ from ``default``, notes grouped per block family)."""
    chains, groups = {}, {}
    for key in keys:
        prefix = key[: -len(".forward")]
        preferred, source, ignored = preference(model_patcher, prefix)
        if ignored:
            code, verdict = "preference_ignored", f"ignored: {ignored}"
        elif preferred is None:
            continue
        elif backend == "auto":
            chains[key] = kernels.BackendChain.for_choice(preferred, prepared=default.prepared)
            code, verdict = "preference_honoured", f"honoured: {preferred} runs first (backend auto)"
        else:
            code, verdict = "preference_overridden", f"overridden by the node's back-end {backend}"
        family = "token_refiner blocks" if ".token_refiner." in prefix else "blocks"
        groups.setdefault((code, family, source, verdict), []).append(int(prefix.split(".")[-2]))
    notes = [Note(code, f"checkpoint attention preference ({source}) on {family} {span(ix)}: {verdict}")
             for (code, family, source, verdict), ix in groups.items()]
    return chains, notes


def plan_h3(model_patcher, model_options, forwards: dict, backend: str, default, taken_over: dict,
            blocks: BlockPath) -> Plan:
    """The H3 patch's plan for one sampling run (rules 2-10): ``forwards`` key -> ours, ``taken_over`` the stock-equal
    forwards replaced when the node executed, ``blocks`` the fast path as installed."""
    patches = model_patcher.object_patches
    fast, block_notes = _block_path_notes(model_patcher, blocks)
    notes = [n for n in (forward_taken_away(model_patcher),) if n]
    notes += check_override_at_sampling(model_patcher, model_options, "h3_forward_patch")
    # rule 8: other nodes' block forwards (the attention they call runs this node's forward), forwards taken over
    theirs = [obj for key in sorted({key.rsplit(".attn.", 1)[0] + ".forward" for key in forwards})
              if is_foreign(obj := patches.get(key))]
    if theirs:
        notes.append(Note("block_forwards", f"composed with another node's block forward ({describe(theirs[0])}) on "
                                            f"{len(theirs)} blocks: the attention it calls runs this node's forward; "
                                            "the block fast path does not run there"))
    notes += [Note("forward_taken_over", f"{node}'s attention forward (stock-equal) on {n} blocks was taken over by "
                                         "this node's; its other patches stay")
              for node, n in sorted(Counter(taken_over.values()).items())] + block_notes
    active = [key for key, fwd in forwards.items() if patches.get(key) is fwd]
    foreign = [key for key in forwards if is_foreign(patches.get(key))]
    if foreign:
        raise forward_conflict(model_patcher, foreign, "replaced (after this node)")
    chains, preference_notes = _preference_plan(model_patcher, active, backend, default)
    notes += preference_notes
    replaced = model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    if replaced and not sparse_node_present(model_patcher):
        notes.append(Note("block_replaces", f"another node replaces {len(replaced)} DiT block(s) (patches_replace "
                                            "'dit'): calls they route to the block's attention run this node's "
                                            "forward and are counted; others are theirs"))
    n_blocks = sum(1 for k in active if ".token_refiner." not in k)
    return Plan(default, chains, tuple(notes), n_blocks, len(active) - n_blocks, fast)


@dataclass(frozen=True)
class BlockPath:
    """The block fast path as installed: key -> our block forward, the stock-equal ones taken over, or why not."""

    forwards: dict = field(default_factory=dict)
    taken_over: dict = field(default_factory=dict)
    declined: str | None = None


def check_block_forwards(model_patcher, keys) -> tuple[list[str], dict[str, str]]:
    """Rule 9 when the node executes: (the keys the fast path may take, the stock-equal forwards among them); another
    node's unknown block forward keeps its block (rule 8)."""
    patches = model_patcher.object_patches
    taken_over = _stock_equal(patches, keys, STOCK_EQUAL_BLOCK_FORWARDS)
    return [k for k in keys if not is_foreign(patches.get(k)) or k in taken_over], taken_over


def _block_path_notes(model_patcher, blocks: BlockPath) -> tuple[int, list[Note]]:
    """Rule 9 on the patch stack sampled: how many blocks run the fast path, and the notes."""
    patches = model_patcher.object_patches
    if blocks.declined:
        return 0, [Note("block_path_off", f"block fast path not installed: {blocks.declined}; "
                                          "the attention-only patch runs")]
    fast = [k for k, fwd in blocks.forwards.items() if patches.get(k) is fwd]
    notes = [Note("block_forward_taken_over", f"{node}'s block forward (stock-equal) on {n} blocks was taken "
                                              "over by this node's block fast path")
             for node, n in sorted(Counter(blocks.taken_over.values()).items())]
    mlp = [k for k in (key[: -len("forward")] + "mlp.forward" for key in fast) if is_foreign(patches.get(k))]
    if mlp:
        notes.append(Note("mlp_forward_composed", f"another node's MLP forward ({describe(patches[mlp[0]])}) runs "
                                                  f"inside this node's block fast path on {len(mlp)} blocks "
                                                  "(this node does not chunk those MLPs)"))
    return len(fast), notes


def plan_override(model_patcher, model_options, ours, default) -> Plan:
    """The attention override's plan for one sampling run (rules 3, 4, 10)."""
    notes = check_override_at_sampling(model_patcher, model_options, "attention_override", ours=ours)
    return Plan(default, notes=tuple(n for n in (forward_taken_away(model_patcher), *notes) if n))
