"""A GGUF file's metadata as the families read it (`weights/gguf_families.py`): llama.cpp's key names, each read
once, and the tensors' shapes."""

from __future__ import annotations


class Meta:
    """A GGUF file's metadata under llama.cpp's key names, and its tensors' shapes (in numpy's order)."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self._read: dict[str, object] = {}
        self.arch: str = self.get("general.architecture")
        self.shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}

    def get(self, key: str, default=None):
        if key not in self._read:  # read once: a vocabulary of 256k strings takes a while
            field = self.reader.fields.get(key)
            self._read[key] = None if field is None else field.contents()
        value = self._read[key]
        return default if value is None else value

    def of(self, key: str, default=None):
        """The architecture's own key: `of("block_count")` reads `llama.block_count` in a Llama file."""
        return self.get(f"{self.arch}.{key}", default)

    def values(self, tensor: str) -> list[float]:
        import gguf

        t = next(t for t in self.reader.tensors if t.name == tensor)
        return [float(v) for v in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
