"""Step 6 of the ring loop: the sampled tokens' way back from the last stage to stage 0.

A mixin of `StageLoop` (its attributes: `cfg`, `stage`, `io`, `planner`, `flex`, `times`, `pending_outputs`,
`next_output`, `_flex_out`), kept apart because the timing argument below is a subject of its own.
"""

from __future__ import annotations

import time

import torch

from ringsched.comm.messages import OutputBatch


class OutputExchange:
    def exchange_outputs(self, t: int, flush: bool = False) -> None:
        """The last stage sends what it holds beyond `depth - 1` (everything when `flush`); stage 0 takes in the
        outputs up to micro-batch `t - pp_loop_size + 1` (up to `t - 1`, all it planned, when `flush`).

        Why `depth - 1` and not `depth`: holding the newest `depth` outputs tied stage 0 to the last stage
        exactly as at depth 0. Planning `t + 1` needs the outputs of `t + 1 - loop`; held `depth` micro-batches,
        they left the last stage only once it had computed `t - 1`, so stage 0 computed `t + 1` beside the last
        stage's `t` and the extra slot gave it no slack. Held `depth - 1`, they leave after `t - 2`: stage 0
        can run a micro-batch further ahead and the ring absorbs a slow micro-batch on either stage. The send
        at the end of `t` waits for stage 0 to take the outputs of `t - depth`, which it does once it has
        posted the proxy of `t + 1`: the same moment this stage needs that proxy, so it costs no wait."""
        depth, loop = self.cfg.pp_async_batch_depth, self.cfg.pp_loop_size
        hold = max(depth - 1, 0)
        if self.stage.is_last:
            while self.pending_outputs and (flush or len(self.pending_outputs) > hold):
                seq, payload = self.pending_outputs.popleft()
                if self.stage.is_first:  # one stage: the outputs never leave the process
                    self._deliver(seq, payload[0] if payload else torch.empty(0, dtype=torch.long))
                    self.next_output = seq + 1
                else:
                    self.io.chan.send(0, "output", seq % loop, seq, payload)
        if not self.stage.is_first or self.stage.is_last:
            return
        upto = t - 1 if flush else t - loop + 1
        while self.next_output <= upto:
            start = time.perf_counter()
            msg = self.io.chan.recv(self.stage.prev, "output", self.next_output)
            self.times.wait_output += time.perf_counter() - start
            if self.flex:
                tokens = self.flex.on_output(msg.seq, msg.tensors)
            else:
                tokens = msg.tensors[0].cpu() if msg.tensors else torch.empty(0, dtype=torch.long)
            self._deliver(msg.seq, tokens)
            self.next_output += 1

    def _output_payload(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Last stage: the output message of one micro-batch (NCCL sends device tensors only)."""
        if self.flex:
            return self.flex.output_payload(tokens, *self._flex_out)
        if not tokens.numel():
            return []
        return [tokens if self.stage.is_first else tokens.to(self.device)]

    def _deliver(self, seq: int, tokens: torch.Tensor) -> None:
        outs = self.planner.on_output(seq, tokens.tolist())
        if outs:
            self.io.front_out.send(OutputBatch(outs))

    def drain(self, t: int) -> None:
        """Idle: settle every output still on its way, so no stage is left holding a send (a gloo send of an
        output completes only when stage 0 receives it) and every finished request gets freed."""
        peer = 0 if self.stage.is_last else self.stage.prev
        self._with_peer(peer, self.exchange_outputs, t, True)
