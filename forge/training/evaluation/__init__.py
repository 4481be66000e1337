"""Evaluation: held-out loss, lm-eval tasks during training, a run's weights loaded for the
scripts beside training."""
