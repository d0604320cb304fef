"""The planner's side of the prefix cache (`BlockTable.cache`): which cached blocks a request starts from, which
blocks a micro-batch computes, and when computed blocks are indexed.

At admission a request takes the longest cached prefix of its tokens (whole blocks, never its last token, which must
run to give logits) and computes from there (one asking for prompt log-probabilities takes none: it needs every
position's logits); its first plan entry names those blocks, so the other stages follow without hashing anything.
A request whose next block another request computes in the same micro-batch waits one micro-batch and finds it
cached. Hashes are kept on the request: its tokens never change.

A block is indexed once the micro-batch computing its KV is planned: every stage runs micro-batches in order, so a
request in a later micro-batch reads it after it is written. With a flexible cut a shared layer's KV reaches stage 0
only with the micro-batch's output, so there blocks are indexed when their micro-batch comes back; a request's next
prompt chunk still goes around while the one before is in flight, its plan naming that micro-batch in `reads` (stage
0 then cuts it no later, so every layer it runs on stage 0 has the earlier chunk's KV there).
"""

from __future__ import annotations

from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv.cache import BlockTable, block_hashes
from ringsched.kv.cp_blocks import CPBlocks
from ringsched.scheduler.request import Request


class PrefixIndex:
    """`requests` is the planner's own dict (by request id), shared, not copied."""

    def __init__(self, blocks: BlockTable | CPBlocks, requests: dict[str, Request]) -> None:
        self.blocks, self.requests = blocks, requests
        self.cache = blocks.cache  # None: prefix caching is off

    def hashes(self, r: Request, full: int) -> list[bytes]:
        """The chained hashes of `r`'s first `full` blocks (kept on the request: its tokens never change)."""
        if len(r.block_hashes) < full:
            bs = self.blocks.block_size
            r.block_hashes = block_hashes(r.ids(0, full * bs), bs, r.block_hashes)
        return r.block_hashes[:full]

    def cached_prefix(self, r: Request) -> list[int]:
        """The cached blocks `r` can start from: its longest cached prefix of whole blocks short of its last token."""
        if self.cache is None or r.params.prompt_logprobs is not None:  # a cached position gives no logits to score
            return []
        return self.cache.lookup(self.hashes(r, (r.num_tokens - 1) // self.blocks.block_size))

    def planned_blocks(self, plan: BatchPlan, entries: list[PlanEntry] | None = None) -> set[bytes]:
        """The prefixes (hashes) of the full blocks `entries` (default: the plan's) compute."""
        if self.cache is None:
            return set()
        bs, out = self.blocks.block_size, set()
        for e in plan.entries if entries is None else entries:
            first, end = e.start // bs, (e.start + len(e.token_ids)) // bs
            if end > first:  # (a decode completes a block once every `bs` steps)
                r = self.requests[e.rid]
                self.hashes(r, end)
                out.update(r.block_hashes[first:end])
        return out

    def computed_beside(self, r: Request, cached: int, planned: set[bytes]) -> bool:
        """`r`'s next block after its `cached` ones is computed in this micro-batch by another request."""
        if not planned or (cached + 1) * self.blocks.block_size >= r.num_tokens:
            return False
        return self.hashes(r, cached + 1)[cached] in planned

    def index(self, r: Request, upto: int) -> None:
        """Index `r`'s full blocks of positions `[0, upto)` in the prefix cache (nothing to do until a block fills)."""
        full = upto // self.blocks.block_size
        if full > self.blocks.indexed(r.rid):
            self.blocks.index(r.rid, self.hashes(r, full))

    def admit(self, r: Request, cached: list[int]) -> None:
        """`r` is admitted starting from its `cached` blocks: count the hit and share the blocks."""
        if self.cache is None:
            return
        self.cache.queries += r.num_tokens
        self.cache.hits += r.num_computed
        if r.num_preemptions == 0 and not r.replay:
            r.cached_tokens = r.num_computed
        self.blocks.share(r.rid, cached)

    def stats(self) -> dict:
        if self.cache is None:
            return {}
        return {
            "prefix_cache_queries": self.cache.queries,
            "prefix_cache_hits": self.cache.hits,
            "kv_cached_idle_blocks": self.blocks.cached_idle_blocks,
        }
