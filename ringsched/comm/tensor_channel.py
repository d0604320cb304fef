"""Typed tensor messages over `torch.distributed`, with a demultiplexer.

A message is a fixed-size int64 header `[kind, slot, seq, n, inline, (dtype, ndim, d0..d3) * n]` and room for
`INLINE_BYTES` of payload. Payloads that fit there travel inside the header: one transfer instead of 1 + n, which
is what a decode step of a few rows sends (a row's seam tensors of a small model, a micro-batch's sampled
tokens); larger ones follow it as `n` tensors of their own. A seam whose shape the receiver knows from the plan goes
without a header, as one flat transfer (`send_known`, `recv_known`). Each transfer costs a round of the transport and of
its Python bindings (on gloo over loopback, ~0.1-0.2 ms one way), and at one request every transfer of the ring
is on the token's path. Sends are `isend`s with at most one message outstanding per destination; the payload is
kept alive until the send completes (gloo reads it asynchronously). Receives block; when a message of
another kind than the one asked for arrives, it is stashed in that kind's inbox and handed out when that
kind is asked for.

Deadline and liveness: the process group is created with `timeout=stage_timeout`, so a receive fails after
that long, and a peer that dies closes its connection, which fails the receive at once.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = {"proxy": 1, "output": 2}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_MAX_TENSORS, _MAX_DIMS = 4, 4
_FIELDS = 5 + _MAX_TENSORS * (2 + _MAX_DIMS)  # the header's int64 fields
INLINE_BYTES = 16384  # payloads up to this size ride in the header (each tensor's bytes at an 8-byte offset)
HEADER_LEN = _FIELDS + INLINE_BYTES // 8  # int64 words


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


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def inlines(tensors: list[torch.Tensor]) -> bool:
    """Whether these payloads fit in the header."""
    return sum(_padded(t.numel() * t.element_size()) for t in tensors) <= INLINE_BYTES


def pack_header(kind: str, slot: int, seq: int, tensors: list[torch.Tensor], device=None) -> torch.Tensor:
    """The header for `tensors`; when they fit (`inlines`), with their bytes in it."""
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a tensor message carries at most {_MAX_TENSORS} tensors")
    inline = inlines(tensors)
    h = [KINDS[kind], slot, seq, len(tensors), int(inline)]
    for t in tensors:
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"tensor of {t.dim()} dims; at most {_MAX_DIMS}")
        dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        h += [_DTYPES.index(t.dtype), t.dim(), *dims]
    h += [0] * (_FIELDS - len(h))
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[:_FIELDS] = torch.tensor(h, dtype=torch.int64)
    if inline:
        room, off = header[_FIELDS:].view(torch.uint8), 0
        for t in tensors:
            n = t.numel() * t.element_size()
            room[off : off + n] = t.contiguous().view(-1).view(torch.uint8)
            off += _padded(n)
    return header


def unpack_header(h: torch.Tensor) -> tuple[str, int, int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    kind, slot, seq, specs, _ = _fields(h[:_FIELDS].tolist())
    return kind, slot, seq, specs


def _fields(v: list[int]):
    kind, slot, seq, n, inline = _KIND_NAMES[v[0]], v[1], v[2], v[3], bool(v[4])
    specs, off = [], 5
    for _ in range(n):
        dtype, ndim = _DTYPES[v[off]], v[off + 1]
        specs.append((dtype, tuple(v[off + 2 : off + 2 + ndim])))
        off += 2 + _MAX_DIMS
    return kind, slot, seq, specs, inline


def inline_tensors(h: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The payloads a header carries, as views of it."""
    room, off, out = h[_FIELDS:].view(torch.uint8), 0, []
    for dtype, shape in specs:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(room[off : off + n].view(dtype).view(shape))
        off += _padded(n)
    return out


class TensorChannel:
    """Point-to-point typed messages between this stage and its neighbours."""

    def __init__(self, device: torch.device | str = "cpu", group=None, poll=None) -> None:
        """`group`: the process group the messages travel in (None: the default one); ranks are global. `poll`:
        how to wait for an operation (`stage/nccl.PolledWait`), or None to block in torch.distributed."""
        self.device, self.group, self.poll = torch.device(device), group, poll
        self._outstanding: dict[int, tuple[list, list[torch.Tensor]]] = {}
        self._inbox: dict[tuple[int, str], deque[TensorMessage]] = defaultdict(deque)
        self.stashed = 0  # how many messages arrived out of order (for tests and logs)
        self.sent_bytes: dict[str, int] = defaultdict(int)  # payload bytes sent, per kind (headers not counted)

    def send(self, dst: int, kind: str, slot: int, seq: int, tensors: list[torch.Tensor]) -> None:
        self.wait_sent(dst)
        tensors = [t.contiguous() for t in tensors]
        header = pack_header(kind, slot, seq, tensors, self.device)
        works = [dist.isend(header, dst, group=self.group)]
        if not inlines(tensors):
            works += [dist.isend(t, dst, group=self.group) for t in tensors]
        self._outstanding[dst] = (works, [header, *tensors])  # keeps the payload alive until done
        self.sent_bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)

    def send_known(self, dst: int, kind: str, tensors: list[torch.Tensor]) -> None:
        """`tensors` as one flat transfer with no header, to a receiver that knows their sizes and dtype
        (`recv_known`): the seam of a fixed cut, whose shape the plan gives. One transfer of the payload's own bytes,
        where a framed message costs a header (~16 KiB) and, past its inline room, a transfer per tensor; on a GPU
        the receiver reads nothing on the host before the payload."""
        self.wait_sent(dst)
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).contiguous()
        work = dist.isend(flat, dst, group=self.group)
        self._outstanding[dst] = ([work], [flat])  # keeps the payload alive until done
        self.sent_bytes[kind] += flat.numel() * flat.element_size()

    def recv_known(self, src: int, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """What `send_known` sent: flat tensors of `numels` elements of `dtype` (views of one buffer)."""
        flat = torch.empty(sum(numels), dtype=dtype, device=self.device)
        self._recv(flat, src)
        return list(flat.split(numels))

    def stats(self) -> dict:
        return {"seam_bytes_sent": self.sent_bytes["proxy"], "output_bytes_sent": self.sent_bytes["output"]}

    def wait_sent(self, dst: int | None = None) -> None:
        for d in [dst] if dst is not None else list(self._outstanding):
            pending = self._outstanding.pop(d, None)
            if pending:
                for w in pending[0]:
                    w.wait() if self.poll is None else self.poll(w, f"a send to rank {d}")

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
        self._recv(header, src)
        kind, slot, seq, specs, inline = _fields(header[:_FIELDS].tolist())
        if inline:
            return TensorMessage(kind, slot, seq, inline_tensors(header, specs))
        tensors = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._recv(t, src)
            tensors.append(t)
        return TensorMessage(kind, slot, seq, tensors)

    def _recv(self, t: torch.Tensor, src: int) -> None:
        if self.poll is None:
            dist.recv(t, src, group=self.group)
        else:
            self.poll(dist.irecv(t, src, group=self.group), f"a receive from rank {src}")
