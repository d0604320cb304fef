"""Every native kernel library a CPU stage may call, built (or found built in the cache) before the stage says it
is ready, so that no request waits for a compiler: on a fresh install the first start takes those seconds, and the
first request after "ready" runs at speed. Each library stays what its own switch and this CPU make it
(`native_build.NativeLibrary.get`); the decode attention kernel is built where its backend is chosen."""

from __future__ import annotations

from ringsched.kernels import decode_layers, gguf_linear, layer_ops, native, small_linear


def build_native(gguf: bool) -> None:
    """Build the libraries of a CPU stage (`gguf`: the quantized GGUF kernels too)."""
    for library in (native.LIBRARY, small_linear.LIBRARY, layer_ops.LIBRARY, decode_layers.LIBRARY):
        library.get()
    if gguf:
        gguf_linear.LIBRARY.get()
