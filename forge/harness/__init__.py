"""Downstream evaluation through lm-evaluation-harness: a forge model as an ``lm_eval`` model,
the tasks it runs, and what they report (docs/evaluation.md)."""
