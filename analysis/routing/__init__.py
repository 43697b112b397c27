"""Which experts each domain and token uses: `python -m analysis.routing` (cli.py).

  collect.py      routes a split through a checkpoint in one jitted pass, keeping counts only (`analyse`)
  stats.py        the accumulators and the metric functions over their counts (NumPy only)
  outputs.py      routing.json, routing.npz, the PNGs and tokens.html of an analysis, and its summary
  plots.py        one function per PNG; scales.py their colour scales relative to chance
  tokens_html.py  tokens.html: sample texts coloured by first-choice expert
  hf_flags.py     the flag combinations the command allows (checked before anything heavy loads)

Importing the package imports none of these: stats.py and collect.py load without matplotlib.
"""

# Punctuation, function words and the newline, frequent in the bundled corpus (routing.json n over its whole
# validation split: "\n" 6,620, "," 6,109, " the" 5,333, "." 5,205, " of" 3,354, ":" 923; "what" was 3), so a
# --max_tokens sample still has enough occurrences for a share per expert.
DEFAULT_TOKENS = (".", ",", ":", " the", " of", "\n")
