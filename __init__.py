"""comfyui-sage-strided-nhd: ComfyUI's entry point (``comfy_entrypoint``) and the web extension's
folder. ComfyUI is imported inside the entry point, so importing this file outside ComfyUI has no
side effects."""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.sage_node import SageStridedNHDExtension

    return SageStridedNHDExtension()
