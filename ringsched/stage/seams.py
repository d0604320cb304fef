"""What a stage does at its two seams, chosen once by its place in the ring (`StageLoop` composes them).

In: the first stage embeds token ids (`Embed`); the others receive the previous stage's `"proxy"` tensors
(`ReceiveProxy`). After the layers: a stage that is not the last passes its output on (`PassOn` as its head,
`SendProxy` to post the send); the last stage samples (`SamplingHead`) and holds the tokens for their way back
(`HoldTokens`).

Under tensor parallelism the seam is sharded: each rank sends 1/tp of `hidden_states` and `residual` to the rank
of the same TP index on the next stage, which rebuilds them with one all-gather over its stage's ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.models.llama import StageModel
from ringsched.models.tp import TPGroup
from ringsched.stage.flex_ring import FixedCut, FlexRing
from ringsched.stage.sampler_state import SamplerState
from ringsched.stage.scored_rows import ScoredRows
from ringsched.stage.times import StageTimes

PeerCall = Callable[..., object]  # (peer, fn, *args): a tensor-channel call whose failure names the peer


class Embed:
    """The first stage: its input is the plan's token ids, nothing to receive."""

    def receive(self, plan: BatchPlan) -> None:
        return None


class ReceiveProxy:
    """A later stage: `[hidden_states, residual, *kv rows]` of the micro-batch from rank `src` of the previous
    stage (with `tp`: this rank's shard of the first two, all-gathered into `[tokens, hidden]`)."""

    def __init__(
        self,
        src: int,
        chan,
        times: StageTimes,
        peer: PeerCall,
        tp: TPGroup | None = None,
        hidden: int = 0,
        known: torch.dtype | None = None,
    ) -> None:
        self.src, self.chan, self.times, self.peer, self.tp, self.hidden = src, chan, times, peer, tp, hidden
        self.known = known  # the seam's dtype, where its shape comes from the plan (`SendProxy.known`)

    def receive(self, plan: BatchPlan) -> dict[str, torch.Tensor] | None:
        if not plan.entries:
            return None
        rows = plan.graph_rows or plan.num_tokens  # the seam's rows (a static step's: its bucket's)
        with self.times.measure("wait_prev"):
            if self.known is not None:  # sized from the plan, no header
                n = rows * self.hidden // (self.tp.size if self.tp else 1)
                tensors = self.peer(self.src, self.chan.recv_known, self.src, [n, n], self.known)
            else:
                tensors = self.peer(self.src, self.chan.recv, self.src, "proxy", plan.seq).tensors
        hidden, residual = tensors[0], tensors[1]
        if self.tp:
            with self.times.measure("comm"):
                shape = (hidden.numel() * self.tp.size // self.hidden, self.hidden)
                hidden, residual = self.tp.seam_gather(hidden, shape), self.tp.seam_gather(residual, shape)
        elif self.known is not None:
            hidden, residual = hidden.view(rows, self.hidden), residual.view(rows, self.hidden)
        return {"hidden_states": hidden, "residual": residual, "kv": tensors[2:]}


class PassOn:
    """Not the last stage: the layers' output goes on as it is, with the K/V rows the cut mirrors."""

    def apply(self, plan: BatchPlan) -> None:
        pass

    def __call__(self, plan: BatchPlan, out: dict, rows: list[torch.Tensor]) -> dict:
        out["kv"] = rows
        return out

    def empty(self) -> None:
        return None


class SamplingHead:
    """The last stage: the final norm, lm_head and sampling of the rows that sample (greedy tokens stay on the
    device; `FixedCut.payload` enqueues their copy to the host)."""

    def __init__(
        self, model: StageModel, sampler: SamplerState, times: StageTimes, cut: FixedCut | FlexRing, active: bool = True
    ) -> None:
        self.model, self.sampler, self.times, self.cut = model, sampler, times, cut
        self.active = active  # False: a CP rank other than the group's first (that one samples every row)

    def apply(self, plan: BatchPlan) -> None:
        self.sampler.apply(plan)

    def __call__(self, plan: BatchPlan, out: dict, rows: list[torch.Tensor]) -> torch.Tensor:
        if not self.active:
            return self.empty()
        with self.times.measure("head") as took:
            scored = ScoredRows.of(plan, self.sampler.params)
            if scored is None and self.sampler.greedy_only(plan):
                tokens = self.sampler.keep(plan, self.model.greedy_tokens(out))  # on the device: no wait here
            else:
                logits = self.model.compute_logits(out)
                scores = torch.empty(0, dtype=torch.long)
                if scored is not None:
                    logits, scores = scored.split(logits)
                targets, tokens = self.sampler.sample(plan, logits)
                # The sampled ids, then any log-probabilities asked for, then the prompt's scores (stage 0 knows
                # how many of each to expect).
                tokens = torch.cat([tokens, self.sampler.logprobs(plan, logits, targets), scores])
        self.cut.head_took(plan.sample_rows, took.seconds)
        self.times.sample_rows += plan.sample_rows
        return tokens

    def empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)


class SendProxy:
    """Not the last stage: post the send of the micro-batch's proxy to rank `dst` of the next stage (asynchronous;
    at most one outstanding per channel, see `TensorChannel`); with `tp`, this rank's shard of it."""

    def __init__(
        self,
        dst: int,
        chan,
        times: StageTimes,
        peer: PeerCall,
        tp: TPGroup | None = None,
        known: torch.dtype | None = None,
    ) -> None:
        self.dst, self.chan, self.times, self.peer, self.tp = dst, chan, times, peer, tp
        # `known`: the seam's dtype where the next stage takes its shape from the plan (a fixed cut, no CP): unframed
        self.known = known
        self.tokens = 0  # tokens sent on (the seam's bytes per token: `TensorChannel.sent_bytes` over this)

    def send(self, plan: BatchPlan, out: dict | None) -> None:
        if not plan.entries:
            return
        seam = [out["hidden_states"], out["residual"]]
        if self.tp:
            seam = [self.tp.seam_shard(t) for t in seam]
        with self.times.measure("comm"):
            if self.known is not None:
                if any(t.dtype != self.known for t in seam):
                    raise RuntimeError(f"the seam is {seam[0].dtype}, not the {self.known} the next stage expects")
                self.peer(self.dst, self.chan.send_known, self.dst, "proxy", seam)
            else:
                seam += out.get("kv", [])
                self.peer(self.dst, self.chan.send, self.dst, "proxy", plan.slot, plan.seq, seam)
        self.tokens += out["hidden_states"].shape[0]  # this rank's rows (a CP rank holds only its own)


class HoldTokens:
    """The last stage: the sampled tokens join the outputs on their way back to stage 0."""

    def __init__(self, cut: FixedCut | FlexRing, outputs, times: StageTimes) -> None:
        self.cut, self.outputs, self.times = cut, outputs, times

    def send(self, plan: BatchPlan, tokens: torch.Tensor) -> None:
        with self.times.measure("comm"):
            self.outputs.hold(plan.seq, self.cut.payload(plan, tokens))
