"""Hyper-token exit: SpecEE early exit inside speculative verification (mode spec-ee)."""
