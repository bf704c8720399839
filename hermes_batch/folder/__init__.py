"""The run folder's durable state: paths and atomic writes, journal, lock, index, merge, statistics."""
