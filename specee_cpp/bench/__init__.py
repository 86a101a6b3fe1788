"""`specee-cpp bench`: our decoding modes against llama.cpp's own speculative tools and
llama-cpp-python's prompt lookup, interleaved prompt by prompt in one run.

prompts (what is decoded) -> configs (how) -> runner (measures, one record per prompt and
configuration, saved as it is made) -> report (JSON, markdown, PNG).
"""
