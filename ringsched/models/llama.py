"""One decoder model class for every stage: Llama, Mistral (no sliding window), Qwen2, Qwen3.

The layer list is always full length; layers the stage does not own are `MissingLayer` placeholders, so
parameter names (`model.layers.17.self_attn.q_proj.weight`) and layer indices stay global. The embedding
exists only on the first stage; the final norm and the lm_head only on the last.

The residual add is fused into the next RMSNorm, so between layers (and across a stage seam) the state is
the pair `(hidden_states, residual)`: a non-last stage returns both, a non-first stage takes both in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringsched.layout.rank import StageInfo
from ringsched.models import layer_ops
from ringsched.models.attention import ForwardBatch, paged_attention
from ringsched.models.config import ModelConfig
from ringsched.models.decode_layers import DecodeLayers
from ringsched.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from ringsched.models.rope import RopeScaling
from ringsched.models.small_linear import Linear
from ringsched.models.tp import SoloGroup, TPGroup
from ringsched.models.vocab import lm_head, vocab_embedding


def cpu_layout(name: str, weight: torch.Tensor) -> torch.Tensor:
    """A decoder layer's projection weight stored `[in, out]` in memory (the same `[out, in]` tensor with
    transposed strides) when it is float32 on a CPU: MKL's sgemm then multiplies without transposing the
    weight, which measured (one thread, SmolLM2 shapes) 10-30% faster at 64-128 rows with the same results bit
    for bit; a whole decode step of 86 rows 13% faster, of 128 rows 7%. The lm_head keeps its layout (no gain
    measured; tied, it is the embedding's rows). Names and shapes do not change. Other tensors: unchanged."""
    if name.startswith("model.layers.") and name.endswith("_proj.weight"):
        return _kn_storage(weight)
    return weight


def _kn_storage(weight: torch.Tensor) -> torch.Tensor:
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        return weight.t().contiguous().t()
    return weight


def fuse_linears(parts: list[nn.Linear]) -> Linear:
    """One `Linear` whose output is the parts' outputs side by side (q/k/v, or gate/up): one weight stream and one
    call instead of several. The parts' parameters become views of the fused ones (names, shapes and memory
    unchanged); the fused layer is not a submodule, so the state dict keeps the checkpoint's names."""
    w = _joined([p.weight for p in parts])
    if w is None:
        w = _kn_storage(torch.cat([p.weight.detach() for p in parts]))
    fused = Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if parts[0].bias is not None:
        b = _joined([p.bias for p in parts])
        b = b if b is not None else torch.cat([p.bias.detach() for p in parts])
        fused.bias = nn.Parameter(b, requires_grad=False)
    _share_rows(fused, parts)
    return fused


def _joined(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one, without a copy, when they are consecutive row ranges of one buffer (the loader puts
    the parts of a fused projection there); else None."""
    first = ts[0]
    offset = first.storage_offset()
    for t in ts:
        same = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.stride() == first.stride()
        if not same or t.storage_offset() != offset:
            return None
        offset += t.shape[0] * t.stride(0)
    rows = sum(t.shape[0] for t in ts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _share_rows(fused: Linear, parts: list[nn.Linear]) -> None:
    """Point each part's weight (bias, int8 scales) at its rows of the fused layer's."""
    start = 0
    for p in parts:
        rows = slice(start, start + p.out_features)
        p.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        if fused.scales is not None:
            p.scales = fused.scales[rows]
        start += p.out_features


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a tensor of `x`'s shape and dtype to write the result into (the caller's dead input), so a step
        allocates one `[tokens, hidden]` buffer fewer; the same values bit for bit (products commute)."""
        dtype = x.dtype
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if out is None or self.weight.dtype != dtype:
            return self.weight * (xf * inv).to(dtype)
        if xf is x:  # float32: the product goes straight into `out`
            torch.mul(xf, inv, out=out)
        else:  # `xf` is this call's own float32 copy: scale it in place, round into `out` as `.to` rounds
            out.copy_(xf.mul_(inv))
        return out.mul_(self.weight)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual += x; return norm(residual), residual` (the first layer starts the residual).

        Both in place: `x` (a layer's output or a stage's input) and the residual are owned by the forward pass
        and `x` is dead after the add, so the sum goes into the residual and the norm into `x`. On a 1B
        model's 512-token chunk that is two 4 MiB buffers fewer per norm at the step's peak. The caller must
        not read `x` or the residual it passed afterwards."""
        if residual is None:
            return self(x), x
        residual.add_(x)  # x + residual, the same bits (addition commutes)
        return self(residual, out=x), residual


class Rotary(nn.Module):
    """Rotate-half RoPE as Hugging Face computes it. One instance serves every layer of a stage: the cos/sin
    table is built once (a 4096-position table is 2 MiB in float32; one per layer was 60 MiB for SmolLM2), and
    the rows for a batch's positions are gathered once per forward, not once per layer."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling or RopeScaling()
        self._cos = self._sin = torch.empty(0)
        self._rows: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self._covered: torch.Tensor | None = None  # the last `positions` `tables` grew the tables for

    def _table(self, n: int, device: torch.device) -> None:
        size = max(n, 2 * self._cos.shape[0], 4096)
        inv_freq, factor = self.scaling.inv_freq(self.head_dim, self.theta)
        freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, device: torch.device):
        # Every layer of one forward passes the same `positions` tensor: gather its rows for the first only.
        if self._rows is not None and self._rows[0] is positions and self._rows[1] == dtype:
            return self._rows[2], self._rows[3]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0] or self._cos.device != device:
            self._table(need, device)
        cos = self._cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self._sin[positions].unsqueeze(1).to(dtype)
        self._rows = (positions, dtype, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions, q.dtype, q.device)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos and sin tables `[P, D]`, grown to cover `positions` (checked once per forward)."""
        if self._covered is not positions:
            need = int(positions.max()) + 1 if positions.numel() else 0
            if need > self._cos.shape[0] or self._cos.device != positions.device:
                self._table(need, positions.device)
            self._covered = positions
        return self._cos, self._sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, the same operations in the same order (so the same bits) with two
    temporaries fewer: the products land in buffers this function owns."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((x2, x1), dim=-1)
    rot[..., : x1.shape[-1]].neg_()
    return (x * cos).add_(rot.mul_(sin))


class Attention(nn.Module):
    """The rank's heads of a layer's attention (`group.shard`: all of them on a stage of one rank): q/k/v
    column-parallel, o_proj row-parallel. `cfg` is the whole model's."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        group = group if group is not None else SoloGroup()
        (q0, h), (k0, kvh) = group.shard.heads(cfg), group.shard.kv_heads(cfg)
        d, hidden, bias = cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = ColumnParallelLinear(hidden, (q0 * d, h * d), cfg.num_heads * d, bias)
        self.k_proj = ColumnParallelLinear(hidden, (k0 * d, kvh * d), cfg.num_kv_heads * d, bias)
        self.v_proj = ColumnParallelLinear(hidden, (k0 * d, kvh * d), cfg.num_kv_heads * d, bias)
        self.o_proj = RowParallelLinear((q0 * d, h * d), cfg.num_heads * d, hidden, group)
        self.__dict__["qkv"] = None  # `fuse_linears` of q/k/v once the weights are in (not a submodule)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary if rotary is not None else Rotary(d, cfg.rope_theta, cfg.rope_scaling)
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor] | None):
        t = x.shape[0]
        if self.qkv is not None:
            sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
            q, k, v = self.qkv(x).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(batch.positions, q, k)
        k_cache, v_cache = kv if kv is not None else (None, None)
        out = paged_attention(q, k, v, batch, k_cache, v_cache, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The rank's rows of a layer's MLP (`group.shard.intermediate`): gate/up column-parallel, down_proj
    row-parallel. `cfg` is the whole model's."""

    def __init__(self, cfg: ModelConfig, group: TPGroup | None = None) -> None:
        super().__init__()
        group = group if group is not None else SoloGroup()
        part, hidden, inter = group.shard.intermediate(cfg), cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, part, inter, bias=False)
        self.up_proj = ColumnParallelLinear(hidden, part, inter, bias=False)
        self.down_proj = RowParallelLinear(part, inter, hidden, group)
        self.__dict__["gate_up"] = None  # `fuse_linears` of gate/up once the weights are in (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.reduce(self._slices(x))  # one sum per layer, after every row slice

    def _slices(self, x: torch.Tensor) -> torch.Tensor:
        pieces = mlp_slices(x.shape[0], self.gate_proj.out_features, x.element_size())
        if pieces == 1:
            return self._rows(x)
        # A long prefill chunk a slice of rows at a time: its `[tokens, intermediate]` gate and up buffers are
        # the largest tensors a step makes (2 x 11 MiB for a 512-token chunk of a 1B model). Each row's result
        # is the same whatever the slice (`tests/test_forward_memory.py`).
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for dst, src in zip(out.tensor_split(pieces), x.tensor_split(pieces), strict=True):
            dst.copy_(self._rows(src))
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        # In place: one [tokens, intermediate] buffer fewer, with the same values bit for bit.
        if self.gate_up is not None:
            h, up = self.gate_up(x).split(self.gate_proj.out_features, dim=-1)
        else:
            h, up = self.gate_proj(x), self.up_proj(x)
        F.silu(h, inplace=True)
        return self.down_proj.partial_sum(h.mul_(up))


MLP_SLICE_BYTES = 8 * 2**20  # an MLP step's [rows, intermediate] buffers above this are cut into row slices


def mlp_slices(tokens: int, intermediate: int, elt: int) -> int:
    """How many equal row slices an MLP step runs in: enough that each `[rows, intermediate]` buffer is at most
    `MLP_SLICE_BYTES`, but none under 128 rows (slower matmuls per row, and each slice reads the weights again)."""
    return max(1, min(-(-tokens * intermediate * elt // MLP_SLICE_BYTES), tokens // 128))


class DecoderLayer(nn.Module):
    """One decoder layer, or the rank's shard of it over `group` (`cfg` is the whole model's)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, group)

    small_ops = False  # `prepare_linears` turns it on where `layer_ops` can run this layer's small steps

    def forward(self, hidden, residual, batch: ForwardBatch, kv):
        small = self.small_ops and kv is not None and hidden.shape[0] <= layer_ops.MAX_ROWS and batch.cp is None
        if small and hidden.is_contiguous() and (residual is None or residual.is_contiguous()):
            return self._small_step(hidden, residual, batch, kv)
        h, residual = self.input_layernorm.add_forward(hidden, residual)
        h = self.self_attn(h, batch, kv)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def _small_step(self, hidden, residual, batch: ForwardBatch, kv):
        """The same layer for a step of a few rows: each elementwise stage one native call (`layer_ops`)."""
        attn, mlp = self.self_attn, self.mlp
        h, residual = layer_ops.add_rmsnorm(hidden, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        q = layer_ops.rope_store(attn.qkv(h), attn.num_heads, attn.num_kv_heads, attn.head_dim, batch.positions,
                                 attn.rotary.tables(batch.positions), kv[0], kv[1], batch.slot_mapping)  # fmt: skip
        out = paged_attention(q, None, None, batch, kv[0], kv[1], attn.scale)  # k and v are in the cache
        out = attn.o_proj(out.view(q.shape[0], -1))
        norm = self.post_attention_layernorm
        h, residual = layer_ops.add_rmsnorm(out, residual, norm.weight, norm.eps)
        return mlp.down_proj(layer_ops.silu_mul(mlp.gate_up(h))), residual


class MissingLayer(nn.Identity):
    """Placeholder for a layer another stage owns: no parameters, never called."""


class StageModel(nn.Module):
    """The part of a decoder one stage runs (one rank's shard of it under tensor parallelism: `tp`, the stage's
    group; None for a stage of one rank). `state_dict` names are the Hugging Face ones; `cfg` is the whole
    model's. The layers are the tensor-parallel types (`models/parallel_linear.py`, `models/vocab.py`), chosen
    here once: the forward code is the same with and without tensor parallelism."""

    def __init__(self, cfg: ModelConfig, stage: StageInfo, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.stage, self.tp = cfg, stage, tp
        group = tp if tp is not None else SoloGroup()
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = vocab_embedding(cfg, group)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # shared by the stage's layers
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, group) if stage.owns(i) else MissingLayer() for i in range(cfg.num_layers)
        )
        if stage.is_last:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = lm_head(cfg, group)

    def forward(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor | None = None,
        proxy: dict[str, torch.Tensor] | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        layers: range | None = None,
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """First stage takes `input_ids` [T], others `proxy`. Returns the proxy dict, or on the last stage
        the final-normed hidden states of `batch.logit_rows` ([S, hidden]). `layers`: the held layers to run
        (default all; a flexible cut runs part of them)."""
        if self.stage.is_first:
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            assert proxy is not None, "a non-first stage needs the previous stage's proxy tensors"
            hidden, residual = proxy["hidden_states"], proxy["residual"]
        todo = layers if layers is not None else range(self.stage.start_layer, self.stage.end_layer)
        # Every layer of a small decode step in one native call, when the layers are known in advance (a range); a
        # flexible cut decided as the layers run (an iterator) runs them one by one.
        whole = self.__dict__.get("decode_layers")
        if isinstance(todo, range) and len(todo) and whole is not None and whole.usable(batch, hidden, residual,
                                                                                         kv_caches):  # fmt: skip
            hidden, residual = whole(batch, hidden, residual, kv_caches, todo)
        else:
            for i in todo:
                kv = kv_caches[i - self.stage.start_layer] if kv_caches is not None else None
                hidden, residual = self.model.layers[i](hidden, residual, batch, kv)
        if not self.stage.is_last:
            return {"hidden_states": hidden, "residual": residual}
        # Only the rows that sample need the final norm and the lm_head.
        rows = batch.logit_rows
        out, _ = self.model.norm.add_forward(hidden[rows], residual[rows])
        return out

    def one_call(self, batch: ForwardBatch) -> bool:
        """Whether a step of `batch` can run its layers in one native call (`models/decode_layers.py`)."""
        whole = self.__dict__.get("decode_layers")
        return whole is not None and whole.takes(batch)

    def lay_out_for_cpu(self) -> StageModel:
        """`cpu_layout` applied to every parameter (models built in place, such as the partition probe's)."""
        for name, p in list(self.named_parameters()):
            laid = cpu_layout(name, p.detach())
            if laid.data_ptr() != p.data_ptr():  # a copy was made: this one is re-laid
                owner, attr = name.rsplit(".", 1)
                setattr(self.get_submodule(owner), attr, nn.Parameter(laid, requires_grad=False))
        return self

    def fusion_groups(self) -> list[list[tuple[str, nn.Linear]]]:
        """(parameter prefix, module) of each group of projections `prepare_linears` fuses: q/k/v and gate/up."""
        groups = []
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer, MissingLayer):
                a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
                attn, mlp = layer.self_attn, layer.mlp
                groups.append([(f"{a}.{n}", getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")])
                groups.append([(f"{m}.gate_proj", mlp.gate_proj), (f"{m}.up_proj", mlp.up_proj)])
        return groups

    def prepare_linears(self, quantization: str = "none") -> StageModel:
        """After the weights are in: fuse each layer's q/k/v and gate/up projections, quantise the projections and
        the lm_head (`int8`: `models/quantize.py`), and let every linear layer pick its kernel."""
        from ringsched.models.quantize import quantize_linear  # quantize imports small_linear, as this does

        for layer in self.model.layers:
            if isinstance(layer, MissingLayer):
                continue
            attn, mlp = layer.self_attn, layer.mlp
            attn.__dict__["qkv"] = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.__dict__["gate_up"] = fuse_linears([mlp.gate_proj, mlp.up_proj])
            if quantization == "int8":
                for fused, parts in ((attn.qkv, [attn.q_proj, attn.k_proj, attn.v_proj]),
                                     (mlp.gate_up, [mlp.gate_proj, mlp.up_proj])):  # fmt: skip
                    quantize_linear(fused)
                    _share_rows(fused, parts)
                quantize_linear(attn.o_proj)
                quantize_linear(mlp.down_proj)
            for lin in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj):
                lin.prepare()
            w = layer.input_layernorm.weight
            same = layer.post_attention_layernorm.weight.dtype == w.dtype
            layer.small_ops = not attn.qk_norm and same and layer_ops.usable(w.dtype, w.device)
        if self.stage.is_last:
            if quantization == "int8":
                quantize_linear(self.lm_head)
            self.lm_head.prepare()
        self.__dict__["decode_layers"] = DecodeLayers(self)
        return self

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S, vocab]` logits of the final hidden states (`LMHead.logits`), whole under tensor parallelism."""
        return self.lm_head.logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S]` argmax of the logits, the first on ties, without building them whole (`LMHead.greedy`)."""
        return self.lm_head.greedy(hidden)
