"""comfyui-sage-strided-nhd: ComfyUI entry point.

ComfyUI imports this package from custom_nodes/ and calls ``comfy_entrypoint``; the web
extension (report status line) is served from ``WEB_DIRECTORY``. ComfyUI modules are
imported inside the entry point so that importing this file outside ComfyUI (test
collection, packaging tools) has no side effects and needs no ComfyUI.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.sage_node import SageStridedNHDExtension

    return SageStridedNHDExtension()
