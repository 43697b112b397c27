"""The decoder-only studies ("why are LLMs decoder-only?"): one folder per study (its config, runner, report,
README and committed results), the code they share in experiments.common. The library (moe, rundir, configs,
train, analysis) never imports this package. Index and command list: experiments/README.md."""
