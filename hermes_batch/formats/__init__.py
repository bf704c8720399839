"""Records and their formats: what a sample is, how it is written, read and checked."""
