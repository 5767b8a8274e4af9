"""Hugging Face interop: parameter names and the per-expert file layout (`names`), safetensors weights read into
and written from a (possibly sharded) model (`weights`), and model folders: what a run writes, what export writes,
what inference and `model.name` load (`folder`).

The `config.json` mapping of an architecture lives with the config schema (`lmforge.config.hf_config`): the config
loader reads it to fill `[model.arch]` from a pretrained folder, and the config layer imports nothing above it."""
