"""One run: its options, its frozen plan, the runner that executes it, resume and clean-up."""
