"""The seventeen toolset distributions of the original Hermes batch runner, registered like any plugin's.

Percents are each toolset's independent chance of being offered on a prompt.
Only ``terminal`` and ``file`` come with the core; the other toolsets named
here (web, vision, image_gen, moa, browser) appear as unavailable until a
plugin provides them.
"""

from __future__ import annotations

import hermes_batch
from hermes_batch.run.distributions import distribution_from_percent

# name -> (description, {toolset: percent}); order of toolsets breaks sampling ties.
SEED_DISTRIBUTIONS: dict[str, tuple[str, dict[str, int]]] = {
    "default": (
        "Every toolset on every prompt.",
        {"web": 100, "vision": 100, "image_gen": 100, "terminal": 100, "file": 100, "moa": 100, "browser": 100},
    ),
    "image_gen": (
        "Image generation and vision on most prompts, with web and terminal support.",
        {"image_gen": 90, "vision": 90, "web": 55, "terminal": 45, "moa": 10},
    ),
    "research": (
        "Web research with the browser, image analysis and mixture-of-agents reasoning.",
        {"web": 90, "browser": 70, "vision": 50, "moa": 40, "terminal": 10},
    ),
    "science": (
        "Scientific problem solving: web, terminal and files nearly always, vision and browser often.",
        {"web": 94, "terminal": 94, "file": 94, "vision": 65, "browser": 50, "image_gen": 15, "moa": 10},
    ),
    "development": (
        "Coding work: terminal and files usually, reasoning often, web lookups now and then.",
        {"terminal": 80, "file": 80, "moa": 60, "web": 30, "vision": 10},
    ),
    "safe": (
        "No terminal: web, browser, vision, image generation and reasoning only.",
        {"web": 80, "browser": 70, "vision": 60, "image_gen": 60, "moa": 50},
    ),
    "balanced": (
        "Each toolset on half of the prompts.",
        {"web": 50, "vision": 50, "image_gen": 50, "terminal": 50, "file": 50, "moa": 50, "browser": 50},
    ),
    "minimal": (
        "Web search alone.",
        {"web": 100},
    ),
    "terminal_only": (
        "Terminal and file tools on every prompt, for code execution tasks.",
        {"terminal": 100, "file": 100},
    ),
    "terminal_web": (
        "Terminal, file and web tools on every prompt, for coding that needs documentation.",
        {"terminal": 100, "file": 100, "web": 100},
    ),
    "creative": (
        "Image generation and vision on most prompts, web occasionally.",
        {"image_gen": 90, "vision": 90, "web": 30},
    ),
    "reasoning": (
        "Mostly mixture-of-agents reasoning, with a little web and terminal.",
        {"moa": 90, "web": 30, "terminal": 20},
    ),
    "browser_use": (
        "Browser control on every prompt, usually with web search and vision.",
        {"browser": 100, "web": 80, "vision": 70},
    ),
    "browser_only": (
        "Browser automation alone, for pure web interaction tasks.",
        {"browser": 100},
    ),
    "browser_tasks": (
        "For browser task sets: the browser almost always, terminal and vision occasionally.",
        {"browser": 97, "vision": 12, "terminal": 15},
    ),
    "terminal_tasks": (
        "For terminal task sets: terminal, files and web almost always, browser and vision often.",
        {"terminal": 97, "file": 97, "web": 97, "browser": 75, "vision": 50, "image_gen": 10},
    ),
    "mixed_tasks": (
        "For mixed browser and terminal tasks: browser, terminal and files usually, the rest occasionally.",
        {"browser": 92, "terminal": 92, "file": 92, "web": 35, "vision": 15, "image_gen": 15},
    ),
}


@hermes_batch.hookimpl
def register_distributions(register):
    """Register the seventeen built-in distributions."""
    for name, (description, percents) in SEED_DISTRIBUTIONS.items():
        register(distribution_from_percent(name, description, percents))
