"""Decoding engine: ``LLM`` (load, tokenize, template, stream), the ``Step``/``Stats``
record every mode yields, the mode registry (``modes``), plain decoding, sampling and the
KV-cache ``Sequence``. Imports nothing above it (docs/ARCHITECTURE.md)."""
