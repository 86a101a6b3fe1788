"""Exceptions of specee-cpp.

Every user-facing mistake (bad path, bad registry name, mismatched draft) raises a subclass
of :class:`SpeceeError` once, with the offending value in the message; the CLI prints that
message as one line and exits non-zero.
"""


class SpeceeError(Exception):
    """Base class: a problem the user can fix, reported as one readable line."""


class ModelFileError(SpeceeError):
    """A model path that is missing, not a GGUF file, truncated or not loadable."""


class RegistryError(SpeceeError):
    """An unknown registry name or a malformed models.toml."""


class PullError(SpeceeError):
    """A model could not be fetched or failed its checksum."""


class TokenizerMismatchError(SpeceeError):
    """Draft and target do not share a tokenizer."""


class UnsupportedArchitectureError(SpeceeError):
    """The GGUF's architecture is not supported by this build or this feature."""


class LibraryError(SpeceeError):
    """The loaded libllama is missing or is not the specee-cpp patched build."""


class FieldError(SpeceeError):
    """A request field whose value cannot be honoured; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class ContextOverflowError(SpeceeError):
    """A prompt plus the requested tokens do not fit in the context window."""


class DecodeError(SpeceeError):
    """llama_decode failed."""
