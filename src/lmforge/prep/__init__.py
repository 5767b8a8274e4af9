"""Data preparation: tokenizers trained on local text, datatrove token shards, eval set files, the chat SFT set
and the demo's data. The `lmforge` commands that drive these live in `lmforge.commands`."""
