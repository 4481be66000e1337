"""Tokenizer, shard format, datasets, sampler and the stateful loader."""
