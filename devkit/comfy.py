"""Find a ComfyUI source tree ("host") and import it in this process (tests and benchmarks).

ComfyUI picks its stock attention function when ``comfy.ldm.modules.attention`` is first
imported, from its command-line flags. Neither tests nor benchmarks run ComfyUI's ``main.py``
in-process, so the flags are set on ``comfy.cli_args.args`` here, before anything imports ``comfy``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # devkit/ sits in the repo root

# Stock ComfyUI attention that runs the same kernel as each of the pack's back-ends.
STOCK_FLAG_FOR_BACKEND = {
    "sage2": "use_sage_attention",
    "sage1": "use_sage_attention",
    "sdpa": "use_pytorch_cross_attention",
    "comfy_kitchen_int8": "use_ck_attention",
}


SAMPLER, SCHEDULER = "res_multistep", "simple"  # the bundled workflows'


def custom_sampling(patcher, conditioning, latent: dict, seed: int, steps: int, sampler: str = SAMPLER):
    """One sampling run as the bundled workflows wire ComfyUI's nodes (RandomNoise, KSamplerSelect, BasicScheduler,
    BasicGuider, SamplerCustomAdvanced), as a callable that returns the output latent dict (the nodes are set up
    here, before a caller's clock starts)."""
    from comfy_extras import nodes_custom_sampler as ncs

    noise = ncs.RandomNoise.execute(seed)[0]
    chosen = ncs.KSamplerSelect.execute(sampler)[0]
    sigmas = ncs.BasicScheduler.execute(patcher, SCHEDULER, steps, 1.0)[0]
    guider = ncs.BasicGuider.execute(patcher, conditioning)[0]
    return lambda: ncs.SamplerCustomAdvanced.execute(noise, guider, chosen, sigmas, latent)[0]


@contextlib.contextmanager
def on_each_step(fn):
    """Within: ComfyUI's progress hook calls ``fn(step, steps)`` as each sampling step ends."""
    import comfy.utils

    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: fn(value, total))
    try:
        yield
    finally:
        comfy.utils.set_progress_bar_global_hook(None)


class NoComfyUIHost(RuntimeError):
    """No ComfyUI source tree with MiniMax H3 was found."""


def is_comfyui_tree(path: Path) -> bool:
    """A ComfyUI checkout with MiniMax H3 (0.33 or later)."""
    return ((path / "main.py").is_file() and (path / "comfy" / "ldm" / "minimax" / "model.py").is_file()
            and (path / "comfy_extras").is_dir())


def find_host() -> Path | None:
    """The ComfyUI host, or None: ``$COMFYUI_PATH``, else ``<repo>/.comfyui``."""
    try:
        return find_comfyui()
    except NoComfyUIHost:
        return None


def find_comfyui(explicit: str | None = None) -> Path:
    """The ComfyUI tree to use: ``explicit``, else ``$COMFYUI_PATH``, else ``<repo>/.comfyui``."""
    candidates = [(explicit, "--comfyui"), (os.environ.get("COMFYUI_PATH"), "COMFYUI_PATH"),
                  (str(REPO_ROOT / ".comfyui"), "the repo's .comfyui folder")]
    tried = []
    for value, origin in candidates:
        if not value:
            continue
        path = Path(value).expanduser().resolve()
        if is_comfyui_tree(path):
            return path
        tried.append(f"{origin}={path}")
    raise NoComfyUIHost("no ComfyUI source tree with comfy/ldm/minimax/model.py found (tried: "
                        + (", ".join(tried) or "nothing") + "). Set COMFYUI_PATH to a ComfyUI checkout "
                        "that has MiniMax H3 (0.33 or later), or run scripts/setup_comfyui_host.sh.")


def import_comfyui(root: Path, *, cpu: bool, stock_flag: str | None, extra_flags: dict | None = None) -> dict:
    """Put ``root`` first on sys.path, set ComfyUI's flags, import comfy. Returns the flags set.

    ComfyUI's own top-level ``nodes`` module must win over this pack's ``nodes/`` package, so the
    ComfyUI root goes in front of the repo root. Calling it again with the same flags is a no-op.
    """
    global _imported, _flags
    if _imported is not None:
        if _imported != (root, cpu, stock_flag):
            raise RuntimeError(f"ComfyUI is already imported here as {_imported}; one process, one set of flags")
        return _flags
    if "comfy" in sys.modules:
        raise RuntimeError("comfy was imported before its flags were set; call devkit.comfy.import_comfyui first")
    if "nodes" in sys.modules and not hasattr(sys.modules["nodes"], "NODE_CLASS_MAPPINGS"):
        raise RuntimeError("this pack's nodes/ package shadows ComfyUI's nodes module in this interpreter")
    sys.path.insert(0, str(root))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    flags = {"cpu": cpu}
    if stock_flag:
        flags[stock_flag] = True
    if not cpu:
        flags["highvram"] = True  # keep the model resident: nothing is offloaded between timed runs
    flags.update(extra_flags or {})
    for name, value in flags.items():
        setattr(args, name, value)
    import comfy.model_management  # noqa: F401  (reads the flags)
    import comfy.ldm.modules.attention  # noqa: F401  (picks the stock attention from them)
    import comfy.utils
    comfy.utils.PROGRESS_BAR_ENABLED = False  # the benchmark prints its own per-step progress
    _import_server_module()
    _imported, _flags = (root, cpu, stock_flag), flags
    return flags


_imported = None
_flags = None


def _import_server_module() -> None:
    """Import ComfyUI's ``server`` module up front, as a running ComfyUI always has it.

    The node's run report looks for ``server.PromptServer`` at the end of each sampling run; a
    first import there would add seconds to whichever layout samples first.
    """
    try:
        import server  # noqa: F401
    except Exception:  # the report then simply finds no server, as in any script
        pass


def stock_attention_name() -> str:
    """Name of the attention function stock ComfyUI's H3 model calls in this process."""
    import comfy.ldm.minimax.model as h3

    return getattr(h3.optimized_attention, "__name__", repr(h3.optimized_attention))


def comfyui_version(root: Path) -> str:
    version_file = root / "comfyui_version.py"
    if version_file.is_file():
        for line in version_file.read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"
