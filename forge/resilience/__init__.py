"""Signals, the per-step control word and non-finite handling."""
