"""The hard parts of a sandbox backend, as public building blocks (exported by ``hermes_batch``).

:class:`~hermes_batch.sandbox_blocks.files.SandboxFolder` and
:func:`~hermes_batch.sandbox_blocks.files.require_regular_file` (link-safe
paths, no FIFOs or devices), :func:`~hermes_batch.sandbox_blocks.commands.run_command`
(a command with a timeout, its output bounded, its process group killed) and
:class:`~hermes_batch.sandbox_blocks.processes.ChildProcess` (a child that can be
signalled safely, with its process group), :func:`~hermes_batch.sandbox_blocks.trees.remove_tree`
(a folder a command made, however deep or locked) and
:class:`~hermes_batch.sandbox_blocks.pool.WarmPool` (sandboxes started ahead of need,
each for one prompt, as the Docker and Singularity backends' ``-S pool=``).  The local sandbox is built from them;
see docs/plugins.md, "Building blocks for sandbox backends".
"""
