"""Mode ``spec``: draft-then-verify speculative decoding and how many tokens to draft.

- ``decode``: the loop (plan, draft, verify, learn) and the acceptance rule;
- ``policies``: the draft-length rules the loop consults (fixed gamma, llama.cpp's p_min
  rule, HF's heuristic, SpecKV's tokens-per-step objective, and ours: cost-aware gamma and
  a cost-aware per-token stop rule), one small interface;
- ``cost``: this machine's measured cost model (target batches, draft tokens), beside the
  policies that read it;
- ``acceptance``: the fitted models (SpecKV-style MLP of the acceptance rate from draft
  confidence/entropy, compression level and candidate gamma; a per-token acceptance MLP);
- ``profile``: step-level records to fit them on; ``simulate``: replays profiled rounds
  under any policy and cost model (e.g. a GPU's);
- ``mode``: the options and the registration.
"""
