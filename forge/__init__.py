"""forge: fault-tolerant LLM pre-training as a pipeline of pure phase functions."""

__version__ = "0.1.0"
