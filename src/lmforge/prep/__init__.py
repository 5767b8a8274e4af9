"""Data preparation commands: `lmforge tokenizer train` and `lmforge tokenize` (text -> datatrove token shards)."""
