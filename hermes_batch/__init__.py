"""hermes-batch: run a tool-using LLM agent over many prompts and keep the sessions as training data."""

import pluggy

__version__ = "0.1.0"

PROJECT_NAME = "hermes_batch"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for plugin hook implementations: ``@hermes_batch.hookimpl``."""
