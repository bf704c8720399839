"""Executors and workers: prompts leased to other processes or machines and their outcomes sent back."""
