"""Tests of hermes-batch-docker (a package, so its conftest never shadows the core suite's ``conftest``)."""
