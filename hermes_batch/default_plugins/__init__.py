"""The core's own features, written as plugins."""
