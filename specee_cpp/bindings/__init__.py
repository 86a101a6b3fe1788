"""Bindings to the patched libllama, in two layers.

``_ffi``: raw ctypes declarations of the symbols our patches add (on top of
``llama_cpp.llama_cpp``, which declares the stock API). ``llama``: owning wrappers
(:class:`Model`, :class:`Context`, :class:`Batch`) that turn status codes into exceptions.
Nothing outside this package touches ctypes.
"""
from .llama import (Batch, Context, Model, cpu_prefetch_bytes, library_file, library_info,
                    quantize_file, set_cpu_prefetch_bytes)

__all__ = ["Batch", "Context", "Model", "cpu_prefetch_bytes", "library_file", "library_info",
           "quantize_file", "set_cpu_prefetch_bytes"]
