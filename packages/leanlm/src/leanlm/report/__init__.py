"""What a run reports: training scalars, `report.md`, its figures and downstream scores.

`metrics` (training scalars and their sinks), `markdown` (`report.md`), `plots` (its figures)
and `downstream` (lm-evaluation-harness scores of each stage's model). Nothing is imported here,
so a training loop that logs metrics does not load the plotting.
"""
