"""hermes-batch-toolbox: the rest of the Hermes agent's toolbox for hermes-batch.

Toolsets ``web`` (web_search, web_extract), ``browser`` (browser_navigate,
browser_snapshot, browser_click, browser_type, browser_scroll, browser_back,
browser_press, browser_get_images, browser_close), ``vision`` (vision_analyze),
``image_gen`` (image_generate) and ``moa`` (mixture_of_agents), with the Hermes
agent's tool names and argument shapes.  Each is configured with
``-T TOOLSET.KEY=VALUE``; see the README of the distribution.
"""

from __future__ import annotations

import hermes_batch
from hermes_batch import Toolset

from .browser import BrowserConfig, BrowserRuntime
from .browser_tools import BROWSER_TOOLS
from .image_gen import IMAGE_GEN_TOOLS, ImageGenConfig, ImageGenRuntime
from .moa import MOA_TOOLS, MoaConfig, MoaRuntime
from .search import SearchProvider, SearchResult
from .vision import VISION_TOOLS, VisionConfig, VisionRuntime
from .web import WEB_TOOLS, WebConfig, WebRuntime

__all__ = ["TOOLSETS", "SearchProvider", "SearchResult"]

TOOLSETS = (
    Toolset("web", "Search the web and read pages.", WEB_TOOLS, WebConfig, WebRuntime),
    Toolset("browser", "Drive a real Chromium: navigate, read, click, type.", BROWSER_TOOLS, BrowserConfig, BrowserRuntime),
    Toolset("vision", "Ask a multimodal model about an image.", VISION_TOOLS, VisionConfig, VisionRuntime),
    Toolset("image_gen", "Generate images from text.", IMAGE_GEN_TOOLS, ImageGenConfig, ImageGenRuntime),
    Toolset("moa", "Mixture-of-agents: several models answer, one combines.", MOA_TOOLS, MoaConfig, MoaRuntime),
)


@hermes_batch.hookimpl
def register_toolsets(register):
    for toolset in TOOLSETS:
        register(toolset)
