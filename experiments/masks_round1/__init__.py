"""The mask study, round 1: causal vs prefix-LM vs mixed decoders, with and without RoPE. Its
conclusions are withdrawn (README.md); the runner stays for reproducibility."""
