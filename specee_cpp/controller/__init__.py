"""Draft-length control for speculative decoding: how many tokens to draft each round.

- ``policies``: the rules ``generate_spec`` consults (fixed gamma, llama.cpp's p_min rule,
  HF's heuristic, SpecKV's tokens-per-step objective, and ours: cost-aware gamma and a
  cost-aware per-token stop rule), one small interface;
- ``acceptance``: the fitted models (SpecKV-style MLP of the acceptance rate from draft
  confidence/entropy, compression level and candidate gamma; a per-token acceptance MLP);
- ``simulate``: replays profiled rounds under any policy and cost model (e.g. a GPU's).
"""
