"""The ring loop in one process: each stage a thread running the real `StageLoop` over a fake stage IO (queues
for the tensor and plan channels and the front end's sockets), so the loop's logic is checked in the fast lane
without processes; `tests/test_ring.py` runs the same ring across real processes, gloo and ZMQ."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import defaultdict

import pytest
import torch

from ringsched.comm.messages import NewRequest, OutputBatch, Shutdown
from ringsched.comm.tensor_channel import SequenceMismatch, TensorMessage
from ringsched.config import EngineConfig
from ringsched.kv.cache import BlockTable, KVPool, blocks_for_memory
from ringsched.layout.partition import stage_ranges
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.planner import Planner
from ringsched.scheduler.speculation import NO_DRAFTS, Speculator
from ringsched.speculative.config import SpeculativeConfig
from ringsched.stage.loop import StageIO, StageLoop
from ringsched.weights.model_config import ModelConfig

TIMEOUT_S = 60.0


class QueueChannel:
    """`TensorChannel` between threads: one queue per (source, destination, kind)."""

    def __init__(self, rank: int, boxes: defaultdict) -> None:
        self.rank, self.boxes = rank, boxes

    def send(self, dst: int, kind: str, slot: int, seq: int, tensors: list[torch.Tensor]) -> None:
        self.boxes[(self.rank, dst, kind)].put(TensorMessage(kind, slot, seq, [t.clone() for t in tensors]))

    def recv(self, src: int, kind: str, seq: int | None = None) -> TensorMessage:
        msg = self.boxes[(src, self.rank, kind)].get(timeout=TIMEOUT_S)
        if seq is not None and msg.seq != seq:
            raise SequenceMismatch(f"expected {kind} {seq}, got {msg.seq}")
        return msg

    def send_known(self, dst: int, kind: str, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])  # as the real channel sends it: one flat payload
        self.boxes[(self.rank, dst, kind)].put(TensorMessage(kind, -1, -1, [flat]))

    def recv_known(self, src: int, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        (flat,) = self.boxes[(src, self.rank, "proxy")].get(timeout=TIMEOUT_S).tensors
        assert flat.dtype == dtype and flat.numel() == sum(numels), (flat.dtype, flat.numel(), numels)
        return list(flat.split(numels))

    def stats(self) -> dict:
        return {}


class QueueSocket:
    """A ZMQ `Pusher`/`Puller` between threads."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def send(self, msg: object) -> None:
        self.q.put(msg)

    def recv(self, timeout_ms: int | None = None) -> object | None:
        try:
            return self.q.get(timeout=None if timeout_ms is None else timeout_ms / 1000)
        except queue.Empty:
            return None

    def drain(self) -> list[object]:
        out = []
        while not self.q.empty():
            out.append(self.q.get_nowait())
        return out


def run_ring(model_dir, requests: list[tuple[list[int], SamplingParams]], pp_size: int, depth: int = 0,
             stats: dict | None = None, channels=None, scores: dict | None = None,
             **cfg_kw) -> dict[str, list[int]]:  # fmt: skip
    """Every request through an in-process ring of `pp_size` stage threads; each request's generated tokens (and
    stage 0's scheduler stats into `stats`, each request's prompt log-probabilities into `scores`).
    `channels(rank)`: that stage's (seam, back) tensor channels (default: `QueueChannel`s); a stage that fails
    fails the call at once."""
    cfg = EngineConfig(pp_size=pp_size, pp_async_batch_depth=depth, kv_cache_memory="8M", **cfg_kw)
    mcfg = ModelConfig.from_dir(model_dir)
    ranges = stage_ranges(cfg.partition(mcfg.num_layers))
    num_blocks = min(blocks_for_memory(mcfg, e - s, torch.float32, 8 << 20, cfg.block_size) for s, e in ranges)
    boxes: defaultdict = defaultdict(queue.Queue)
    channels = channels or (lambda rank: (QueueChannel(rank, boxes), QueueChannel(rank, boxes)))
    plans = [QueueSocket() for _ in range(pp_size)]  # plans[k]: stage k-1 -> k
    front_in, front_out = QueueSocket(), QueueSocket()
    device = torch.device("cpu")
    loops = []
    for rank, (start, end) in enumerate(ranges):
        stage = StageInfo(rank, pp_size, start, end)
        blocks = BlockTable(num_blocks, cfg.block_size, follower=not stage.is_first,
                            prefix_caching=cfg.enable_prefix_caching)  # fmt: skip
        planner = None
        if stage.is_first:
            speculator = NO_DRAFTS
            if cfg.speculative_config:
                speculator = Speculator(SpeculativeConfig.parse(cfg.speculative_config), blocks, 2048)
            planner = Planner(blocks, cfg.micro_batch_size, cfg.max_running_requests, cfg.chunked_prefill_size,
                              tuple(mcfg.eos_token_ids), 2048, random.Random(0), mcfg.vocab_size,
                              speculator=speculator)  # fmt: skip
        seam, back = channels(rank)
        io = StageIO(
            seam=seam, back=back, plan_in=plans[rank] if rank else None,
            plan_out=plans[rank + 1] if rank + 1 < pp_size else None,
            front_in=front_in if stage.is_first else None, front_out=front_out if stage.is_first else None,
            alive=lambda: None, report=lambda stats: None,
        )  # fmt: skip
        pool = KVPool(mcfg, stage.num_layers, num_blocks, cfg.block_size, torch.float32, device)
        model = load_stage_model(model_dir, stage)
        loops.append(StageLoop(cfg, stage, model, blocks, pool, io, planner, device, tuple(mcfg.eos_token_ids)))
    errors: list[BaseException] = []

    def run(loop: StageLoop) -> None:
        try:
            loop.run()
        except BaseException as e:  # surfaced by the test below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(loop,), daemon=True) for loop in loops]
    for t in threads:
        t.start()
    rids = [f"r{i}" for i in range(len(requests))]
    for rid, (ids, params) in zip(rids, requests, strict=True):
        front_in.send(NewRequest(rid, ids, params.to_dict()))
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    done: set[str] = set()
    deadline = time.monotonic() + TIMEOUT_S
    while len(done) < len(rids):
        msg = front_out.recv(timeout_ms=100)
        assert not errors, errors
        if msg is None:
            assert time.monotonic() < deadline, "the ring went silent"
            continue
        deadline = time.monotonic() + TIMEOUT_S
        assert isinstance(msg, OutputBatch)
        for o in msg.outputs:
            assert o.finish_reason != "error", o.error
            out[o.rid] += o.token_ids
            if scores is not None and o.prompt_logprobs is not None:
                scores[o.rid] = o.prompt_logprobs
            if o.finish_reason:
                done.add(o.rid)
    front_in.send(Shutdown("test"))
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a stage did not stop"
    assert all(loop.blocks.used_blocks == 0 for loop in loops), "KV left allocated"
    if stats is not None:
        stats.update(loops[0].planner.stats())
    return out


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(1)
    greedy = [([rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))],
               SamplingParams(max_tokens=rng.randint(3, 12), temperature=0, ignore_eos=True)) for _ in range(10)]
    seeded = [([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True))]
    # outputs that fall into a loop: what a drafter proposes from (test_speculative_decoding_...)
    looping = [([9, 10, 11, 12] * 6, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
               ([7, 8] * 10, SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True,
                                             repetition_penalty=1.1, logprobs=2)),
               ([3, 4, 5, 3, 4, 6, 3, 4, 7, 3, 4, 8, 3, 4],
                SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    return greedy + seeded + looping  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    reqs = _requests(ModelConfig.from_dir(tiny_llama_dir).vocab_size)
    return reqs, run_ring(str(tiny_llama_dir), reqs, pp_size=1)


@pytest.mark.parametrize("pp_size, depth", [(2, 0), (2, 1), (3, 0), (3, 2)])
def test_every_layout_gives_the_same_tokens(tiny_llama_dir, reference, pp_size, depth):
    reqs, expected = reference
    assert run_ring(str(tiny_llama_dir), reqs, pp_size=pp_size, depth=depth) == expected


def test_small_chunks_and_micro_batches_give_the_same_tokens(tiny_llama_dir, reference):
    reqs, expected = reference
    got = run_ring(str(tiny_llama_dir), reqs, pp_size=2, chunked_prefill_size=7, pp_max_micro_batch_size=2)
    assert got == expected


@pytest.mark.parametrize("pp_size, method", [(1, "ngram"), (2, "ngram"), (2, "suffix")])
def test_speculative_decoding_gives_the_same_tokens(tiny_llama_dir, reference, pp_size, method):
    """Drafts verified in the ring change how fast, never what: greedy and seeded rows (penalties and logprobs
    too) give the tokens decoding without drafts gives, and some drafts were kept and some rejected."""
    reqs, expected = reference
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    stats: dict = {}
    assert run_ring(str(tiny_llama_dir), reqs, pp_size=pp_size, speculative_config=spec, stats=stats) == expected
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


def test_greedy_matches_transformers(tiny_llama_dir, reference):
    transformers = pytest.importorskip("transformers")
    reqs, expected = reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    for i, (ids, params) in enumerate(reqs):
        if not params.greedy:
            continue
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=params.max_tokens, do_sample=False,
                              min_new_tokens=params.max_tokens, pad_token_id=0)  # fmt: skip
        assert gen[0, len(ids) :].tolist() == expected[f"r{i}"]
