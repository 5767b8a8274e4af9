"""lmforge: pretraining and SFT of decoder-only language models through one trainer."""

__version__ = "0.1.0"
