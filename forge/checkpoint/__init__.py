"""Checkpoint policy (pure), the DCP store and resume resolution."""
