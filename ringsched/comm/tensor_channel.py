"""Typed tensor messages over `torch.distributed`, with a demultiplexer.

A message is a fixed-size int64 header `[kind, slot, seq, n, (dtype, ndim, d0..d3) * n]` followed by its
`n` payload tensors. Sends are `isend`s with at most one message outstanding per destination; the payload is
kept alive until the send completes (gloo reads it asynchronously). Receives block; when a message of
another kind than the one asked for arrives, it is stashed in that kind's inbox and handed out when that
kind is asked for.

Deadline and liveness: the process group is created with `timeout=stage_timeout`, so a receive fails after
that long, and a peer that dies closes its connection, which fails the receive at once.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = {"proxy": 1, "output": 2}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_MAX_TENSORS, _MAX_DIMS = 4, 4
HEADER_LEN = 4 + _MAX_TENSORS * (2 + _MAX_DIMS)


_SOURCE_PATH = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|c|h|hpp):\d+\]\s*")


def without_source_paths(text: str) -> str:
    """`Connection closed by peer [...]` without gloo's `[/path/to/pair.cc:534] ` prefix: what people read."""
    return _SOURCE_PATH.sub("", text)


class SequenceMismatch(RuntimeError):
    pass


@dataclass
class TensorMessage:
    kind: str
    slot: int
    seq: int
    tensors: list[torch.Tensor]


def pack_header(kind: str, slot: int, seq: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a tensor message carries at most {_MAX_TENSORS} tensors")
    h = [KINDS[kind], slot, seq, len(tensors)]
    for t in tensors:
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"tensor of {t.dim()} dims; at most {_MAX_DIMS}")
        dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        h += [_DTYPES.index(t.dtype), t.dim(), *dims]
    h += [0] * (HEADER_LEN - len(h))
    return torch.tensor(h, dtype=torch.int64)


def unpack_header(h: torch.Tensor) -> tuple[str, int, int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    v = h.tolist()
    kind, slot, seq, n = _KIND_NAMES[v[0]], v[1], v[2], v[3]
    specs, off = [], 4
    for _ in range(n):
        dtype, ndim = _DTYPES[v[off]], v[off + 1]
        specs.append((dtype, tuple(v[off + 2 : off + 2 + ndim])))
        off += 2 + _MAX_DIMS
    return kind, slot, seq, specs


class TensorChannel:
    """Point-to-point typed messages between this stage and its neighbours."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._outstanding: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self._inbox: dict[tuple[int, str], deque[TensorMessage]] = defaultdict(deque)
        self.stashed = 0  # how many messages arrived out of order (for tests and logs)
        self.sent_bytes: dict[str, int] = defaultdict(int)  # payload bytes sent, per kind (headers not counted)

    def send(self, dst: int, kind: str, slot: int, seq: int, tensors: list[torch.Tensor]) -> None:
        self.wait_sent(dst)
        tensors = [t.contiguous() for t in tensors]
        header = pack_header(kind, slot, seq, tensors).to(self.device)
        works = [dist.isend(header, dst)] + [dist.isend(t, dst) for t in tensors]
        self._outstanding[dst] = (works, [header, *tensors])  # keeps the payload alive until done
        self.sent_bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)

    def stats(self) -> dict:
        return {"seam_bytes_sent": self.sent_bytes["proxy"], "output_bytes_sent": self.sent_bytes["output"]}

    def wait_sent(self, dst: int | None = None) -> None:
        for d in [dst] if dst is not None else list(self._outstanding):
            pending = self._outstanding.pop(d, None)
            if pending:
                for w in pending[0]:
                    w.wait()

    def recv(self, src: int, kind: str, seq: int | None = None) -> TensorMessage:
        """The next message of `kind` from `src`; messages of other kinds are stashed meanwhile."""
        while not self._inbox[(src, kind)]:
            msg = self._recv_one(src)
            if msg.kind != kind:
                self.stashed += 1
            self._inbox[(src, msg.kind)].append(msg)
        msg = self._inbox[(src, kind)].popleft()
        if seq is not None and msg.seq != seq:
            raise SequenceMismatch(
                f"expected {kind} message of micro-batch {seq} from stage {src}, got micro-batch {msg.seq}: the "
                "stages disagree on the batch order"
            )
        return msg

    def _recv_one(self, src: int) -> TensorMessage:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        kind, slot, seq, specs = unpack_header(header.cpu())
        tensors = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src)
            tensors.append(t)
        return TensorMessage(kind, slot, seq, tensors)
