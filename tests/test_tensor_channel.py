"""The demultiplexer over real gloo: a message of the wrong kind is stashed and delivered later."""

import datetime
import multiprocessing as mp

import pytest
import torch

from ringsched.comm.tensor_channel import (
    HEADER_LEN,
    INLINE_BYTES,
    SequenceMismatch,
    TensorChannel,
    inline_tensors,
    inlines,
    pack_header,
    unpack_header,
)
from ringsched.process.ports import free_port

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's


def test_header_round_trip():
    ts = [torch.zeros(3, 5), torch.zeros(7, dtype=torch.int64)]
    kind, slot, seq, specs = unpack_header(pack_header("proxy", 2, 41, ts))
    assert (kind, slot, seq) == ("proxy", 2, 41)
    assert specs == [(torch.float32, (3, 5)), (torch.int64, (7,))]
    assert pack_header("output", 0, 0, []).shape == (HEADER_LEN,)


def test_small_payloads_ride_in_the_header():
    ts = [torch.randn(1, 576), torch.randn(3).bfloat16(), torch.arange(5), torch.empty(0, 4)]
    assert inlines(ts)
    header = pack_header("proxy", 1, 9, ts)
    _, _, _, specs = unpack_header(header)
    for got, sent in zip(inline_tensors(header, specs), ts, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    # one byte past the room: the payloads go as tensors of their own
    assert not inlines([torch.zeros(INLINE_BYTES // 4 - 1), torch.zeros(2)])


def _peer(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    chan = TensorChannel()
    try:
        if rank == 0:
            # Sent in this order: output(seq 5), output(seq 6), proxy(seq 7).
            chan.send(1, "output", 1, 5, [torch.tensor([11, 12])])
            chan.send(1, "output", 0, 6, [])
            chan.send(1, "proxy", 1, 7, [torch.full((2, 3), 7.0), torch.ones(2, 3)])
            chan.send(1, "proxy", 0, 8, [torch.full((40, 576), 8.0), torch.ones(40, 576)])  # beyond the header's room
            chan.wait_sent()
            q.put("sent")
        else:
            # Asked for in another order: the proxy first, so both outputs must be stashed.
            proxy = chan.recv(0, "proxy", seq=7)
            stashed = chan.stashed
            out5 = chan.recv(0, "output", seq=5)
            out6 = chan.recv(0, "output", seq=6)
            big = chan.recv(0, "proxy", seq=8).tensors
            assert big[0].shape == (40, 576) and bool((big[0] == 8.0).all()) and bool((big[1] == 1.0).all())
            q.put((proxy.tensors[0].tolist(), proxy.slot, stashed, out5.tensors[0].tolist(), out6.tensors))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_demux_stashes_the_wrong_kind():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60), q.get(timeout=60)]
    for p in procs:
        p.join(30)
    got = next(r for r in results if r != "sent")
    proxy, slot, stashed, out5, out6 = got
    assert proxy == [[7.0] * 3] * 2 and slot == 1
    assert stashed == 2  # both outputs arrived before the proxy and waited in their inbox
    assert out5 == [11, 12] and out6 == []
    assert all(p.exitcode == 0 for p in procs)


def test_sequence_mismatch_is_loud():
    chan = TensorChannel()
    from ringsched.comm.tensor_channel import TensorMessage

    chan._inbox[(0, "proxy")].append(TensorMessage("proxy", 0, 3, []))
    with pytest.raises(SequenceMismatch, match="micro-batch 4"):
        chan.recv(0, "proxy", seq=4)
