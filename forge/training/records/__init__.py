"""Run records and resume rules: what a checkpoint records of its run, the run directory and
its records, the one table of resume rules, what a resume checks besides the tensors."""
