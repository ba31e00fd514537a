"""comfyui-sage-strided-nhd: ComfyUI entry point.

ComfyUI imports this package from custom_nodes/ and calls ``comfy_entrypoint``. The
web extension (report panel) is served from ``WEB_DIRECTORY``.
"""

from comfy_api.latest import ComfyExtension

from .nodes import NODES

WEB_DIRECTORY = "./web"


class SageStridedNHDExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> SageStridedNHDExtension:
    return SageStridedNHDExtension()
