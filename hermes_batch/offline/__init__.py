"""Commands over a finished run folder that call no model: export, refilter, stats, import."""
