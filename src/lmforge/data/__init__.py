"""Data: the micro-batch contract and how a step's windows are dealt (`batch`), what the trainer needs of a data
type (`base`), token shards (`shards`), the token pool and its windows (`tokens`), mixtures and their sources
(`mixture`, `sources`), SFT samples (`sft`, `chat`, `records`) and packing (`packing`), generated data (`fake`),
the tokenizer (`tokenizer`), background preparation of steps (`prefetch`) and a rank's stream (`stream`). It knows
nothing of models."""
