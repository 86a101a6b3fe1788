"""Bindings to the patched libllama, in two layers.

``_ffi``: raw ctypes declarations of the symbols our patches add (on top of
``llama_cpp.llama_cpp``, which declares the stock API). ``llama``: owning wrappers
(:class:`Model`, :class:`Context`, :class:`Batch`) that turn status codes into exceptions.
Nothing outside this package touches ctypes.
"""
from .llama import (KERNEL_SWITCHES, Batch, Context, Model, kernel_switch, library_file,
                    library_info, quantize_file, set_kernel_switch)

__all__ = ["KERNEL_SWITCHES", "Batch", "Context", "Model", "kernel_switch", "library_file",
           "library_info", "quantize_file", "set_kernel_switch"]
