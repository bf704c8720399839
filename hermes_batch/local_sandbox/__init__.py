"""The local sandbox backend: a folder, a process namespace and its owned processes."""
