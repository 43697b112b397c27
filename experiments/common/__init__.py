"""What the studies share: command-line plumbing (cli), run fingerprints and metrics (runs), validation rows
(rows), n-gram references (refs), probes beyond the loss (probes), paired-seed statistics (stats), pre-registered
verdicts (verdicts), figures (plots), and docs/inference.md's rules: their statistics (inference) and the
re-derivation of every committed conclusion under them (rederive)."""
