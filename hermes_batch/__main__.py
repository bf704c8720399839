"""``python -m hermes_batch`` runs the command line."""

from .cli import main

main()
