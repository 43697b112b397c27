"""Encoder-decoder vs decoder-only: the 2x2 at P and 2P parameters, with the same train step and
targets. The encoder-decoder model (model.py) is study-only: the library's model is decoder-only."""
