"""Contexts, setup phases, step functions, the loop (a reducer), finalize and hooks."""
