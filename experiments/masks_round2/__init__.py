"""The mask study, round 2: causal, prefix-LM, mixed and causal with loss on every token (plus the
equal-targets control and the NoPE arms), paired seeds, a pre-registered gate, Holm and equivalence."""
