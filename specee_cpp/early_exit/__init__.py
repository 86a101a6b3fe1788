"""SpecEE on llama.cpp: candidate providers, per-layer exit predictors, the layer scheduler,
calibration and the early-exit decoding strategy."""
