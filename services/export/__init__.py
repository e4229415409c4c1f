"""`dfpipe export` (a run's drafter as a directory an engine serves) and `dfpipe export-data` (its regenerated
completions as a dataset others can train on)."""
