"""What a user runs on any run or imported model, one command per analysis:

  python -m analysis.loss_curves      loss_curves.py
  python -m analysis.routing          routing/         which experts each domain and token uses
  python -m analysis.specialization   specialization/  the routing metrics against step 0 and a random router
  python -m analysis.ablate           ablate/          each expert removed: the loss change against its share
  python -m analysis.dynamics         dynamics/        saturation, load and biases over the checkpoints
  python -m analysis.rank             rank/            attention rank and rank collapse (rank.logits: logits)
  python -m analysis.tiny_hf          tiny_hf.py       a tiny random HF checkpoint to try routing --hf on

figures.py holds what every plot shares; hf_source.py opens a HuggingFace directory as a run (routing --hf).
"""
