"""The plugin contract: the base classes plugins subclass, the hooks, the plugin manager, toolsets, writers."""
