"""The tiny-GGUF writer lives in the package (the set-up crash probe uses it too)."""
from specee_cpp.models.tiny import copy_tokenizer, tiny_vocab, write_tiny_model  # noqa: F401
