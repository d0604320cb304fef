"""A decoder layer (or one rank's shard of it under tensor parallelism): attention over the paged KV cache and
the SiLU MLP, each between a fused residual-add RMSNorm. The projections are the tensor-parallel types
(`models/parallel_linear.py`), so the same forward code runs with and without tensor parallelism.

A layer writes over its inputs (residual add and norms in place, long prefill MLP steps in row slices: fewer
activation buffers, the same values); a step of a few rows runs its elementwise stages as native calls
(`layer_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringsched.attention import window as window_attention
from ringsched.attention.paged import ForwardBatch, paged_attention
from ringsched.kernels import layer_ops, triton_layer_ops
from ringsched.kernels.quantize import quantize_projection
from ringsched.kernels.small_linear import Linear
from ringsched.models.fused_linear import fuse_linears, share_rows
from ringsched.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from ringsched.models.rmsnorm import RMSNorm
from ringsched.models.rope import Rotary
from ringsched.models.tp import SoloGroup, TPGroup
from ringsched.weights import gguf_kept
from ringsched.weights.model_config import ModelConfig


class Attention(nn.Module):
    """The rank's heads of layer `layer`'s attention (`group.shard`: all of them on a stage of one rank): q/k/v
    column-parallel, o_proj row-parallel. `cfg` is the whole model's. A sliding or soft-capped layer attends
    through `window_attention` (`attend`); the others through the stage's backend. `norm`: the q/k norm's type."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: Rotary | None = None,
        group: TPGroup | None = None,
        layer: int = 0,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        group = group if group is not None else SoloGroup()
        (q0, h), (k0, kvh) = group.shard.heads(cfg), group.shard.kv_heads(cfg)
        d, hidden, bias = cfg.head_dim, cfg.hidden_size, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = ColumnParallelLinear(hidden, (q0 * d, h * d), cfg.num_heads * d, bias)
        self.k_proj = ColumnParallelLinear(hidden, (k0 * d, kvh * d), cfg.num_kv_heads * d, bias)
        self.v_proj = ColumnParallelLinear(hidden, (k0 * d, kvh * d), cfg.num_kv_heads * d, bias)
        self.o_proj = RowParallelLinear((q0 * d, h * d), cfg.num_heads * d, hidden, group, cfg.o_proj_bias)
        self.__dict__["qkv"] = None  # `fuse_linears` of q/k/v once the weights are in (not a submodule)
        if cfg.qk_norm:
            self.q_norm = norm(d, cfg.rms_norm_eps)
            self.k_norm = norm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary if rotary is not None else Rotary(d, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.query_scale or d**-0.5
        self.attend = window_attention.for_layer(cfg.window(layer), cfg.attn_softcap)  # None: the backend's
        self.slides = bool(cfg.window(layer))  # its KV in the sliding pool, addressed by `batch.sliding`

    @property
    def plain(self) -> bool:
        """Whether the native small step can run it: no q/k norm, no window, no soft-capping, whole heads rotated."""
        return not self.qk_norm and self.attend is None and not self.rotary.partial

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o_proj] if self.qkv is not None else [self.q_proj, self.k_proj, self.v_proj, self.o_proj]

    def fusion_groups(self, prefix: str) -> list[list[tuple[str, nn.Linear]]]:
        return [[(f"{prefix}.{n}", getattr(self, n)) for n in ("q_proj", "k_proj", "v_proj")]]

    def prepare_linears(self, quantization: str) -> None:
        """After the weights are in: fuse q/k/v, quantise (`int8`), let each linear layer pick its kernel."""
        self.__dict__["qkv"] = prepare_fused([self.q_proj, self.k_proj, self.v_proj], quantization)
        prepare_single(self.o_proj, quantization)

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
        q, k = self.rotary(batch.positions, q, k, batch.position_bound)
        k_cache, v_cache = kv if kv is not None else (None, None)
        if self.slides and batch.sliding is not None:
            batch = batch.sliding
        out = paged_attention(q, k, v, batch, k_cache, v_cache, self.scale, self.attend)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The rank's rows of a layer's MLP (`group.shard.intermediate`): gate/up column-parallel, down_proj
    row-parallel; the gate's activation SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, `cfg.hidden_act`).
    `cfg` is the whole model's."""

    def __init__(self, cfg: ModelConfig, group: TPGroup | None = None) -> None:
        super().__init__()
        group = group if group is not None else SoloGroup()
        part, hidden, inter = group.shard.intermediate(cfg), cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, part, inter, bias=cfg.mlp_bias)
        self.up_proj = ColumnParallelLinear(hidden, part, inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(part, inter, hidden, group, cfg.mlp_bias)
        self.__dict__["gate_up"] = None  # `fuse_linears` of gate/up once the weights are in (not a submodule)
        self.act = getattr(cfg, "hidden_act", "silu")

    def linears(self) -> list[Linear]:
        return (
            [self.gate_up, self.down_proj]
            if self.gate_up is not None
            else [self.gate_proj, self.up_proj, self.down_proj]
        )

    def fusion_groups(self, prefix: str) -> list[list[tuple[str, nn.Linear]]]:
        return [[(f"{prefix}.gate_proj", self.gate_proj), (f"{prefix}.up_proj", self.up_proj)]]

    def prepare_linears(self, quantization: str) -> None:
        self.__dict__["gate_up"] = prepare_fused([self.gate_proj, self.up_proj], quantization)
        prepare_single(self.down_proj, quantization, down=True)

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
        h = ACTIVATIONS[self.act](h)
        return self.down_proj.partial_sum(h.mul_(up))


ACTIVATIONS = {
    "silu": lambda h: F.silu(h, inplace=True),
    "gelu_pytorch_tanh": lambda h: F.gelu(h, approximate="tanh"),
}
MLP_SLICE_BYTES = 8 * 2**20  # an MLP step's [rows, intermediate] buffers above this are cut into row slices


def mlp_slices(tokens: int, intermediate: int, elt: int) -> int:
    """How many equal row slices an MLP step runs in: enough that each `[rows, intermediate]` buffer is at most
    `MLP_SLICE_BYTES`, but none under 128 rows (slower matmuls per row, and each slice reads the weights again)."""
    return max(1, min(-(-tokens * intermediate * elt // MLP_SLICE_BYTES), tokens // 128))


class DecoderLayer(nn.Module):
    """Decoder layer `layer`, or the rank's shard of it over `group` (`cfg` is the whole model's): pre-norm
    attention and MLP (Llama, Mistral, Qwen, Phi-3); `ffn` in place of the dense MLP (a mixture of experts),
    a submodule named `ffn_name` as the checkpoint names it (Mixtral's `block_sparse_moe`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: Rotary | None = None,
        group: TPGroup | None = None,
        layer: int = 0,
        ffn: nn.Module | None = None,
        ffn_name: str = "mlp",
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, group, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn if ffn is not None else MLP(cfg, group))

    @property
    def ffn(self) -> nn.Module:
        """The MLP or the mixture of experts."""
        return getattr(self, self.ffn_name)

    # What runs this layer's small steps (`_small_step`), set by `prepare_linears`: the CPU's native `layer_ops`,
    # the GPU's `triton_layer_ops`, or None (the torch path only)
    step_ops = None
    small_rows = 0  # steps of up to this many rows take them (every step: `batch_invariant`)

    def linears(self) -> list[Linear]:
        """The linear layers a step calls (after `prepare_linears`)."""
        return self.self_attn.linears() + self.ffn.linears()

    def fusion_groups(self, prefix: str) -> list[list[tuple[str, nn.Linear]]]:
        """(parameter prefix, module) of each group of projections `prepare_linears` fuses: q/k/v and gate/up;
        `prefix` is the layer's (`model.layers.3`)."""
        attn = self.self_attn.fusion_groups(f"{prefix}.self_attn")
        return attn + self.ffn.fusion_groups(f"{prefix}.{self.ffn_name}")

    def prepare_linears(self, quantization: str = "none") -> None:
        """After the weights are in: fuse q/k/v and gate/up, quantise the projections (`int8`:
        `kernels/quantize.py`), let each linear layer pick its kernel, and decide `step_ops`."""
        self.self_attn.prepare_linears(quantization)
        self.ffn.prepare_linears(quantization)
        w = self.input_layernorm.weight
        same = self.post_attention_layernorm.weight.dtype == w.dtype
        plain = self.self_attn.plain and type(self.ffn) is MLP and self.ffn.act == "silu"
        plain = plain and self.self_attn.qkv is not None and self.ffn.gate_up is not None  # fused (kept GGUF types)
        self.step_ops = step_ops_for(w.dtype, w.device) if plain and same else None
        self.small_rows = self.step_ops.MAX_ROWS if self.step_ops is not None else 0

    def forward(self, hidden, residual, batch: ForwardBatch, kv):
        small = kv is not None and 0 < hidden.shape[0] <= self.small_rows  # CP: a rank may hold none
        if small and hidden.is_contiguous() and (residual is None or residual.is_contiguous()):
            return self._small_step(hidden, residual, batch, kv)
        h, residual = self.input_layernorm.add_forward(hidden, residual)
        h = self.self_attn(h, batch, kv)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.ffn(h), residual

    def _small_step(self, hidden, residual, batch: ForwardBatch, kv):
        """The same layer for a step of a few rows: each elementwise stage one call of `step_ops` (a native call
        on CPU, a Triton launch on a GPU)."""
        attn, mlp, ops = self.self_attn, self.mlp, self.step_ops
        h, residual = ops.add_rmsnorm(hidden, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        q = ops.rope_store(
            attn.qkv(h),
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            batch.positions,
            attn.rotary.tables(batch.positions, batch.position_bound),
            kv[0],
            kv[1],
            batch.slot_mapping,
        )
        out = paged_attention(q, None, None, batch, kv[0], kv[1], attn.scale)  # k and v are in the cache
        out = attn.o_proj(out.view(q.shape[0], -1))
        norm = self.post_attention_layernorm
        h, residual = ops.add_rmsnorm(out, residual, norm.weight, norm.eps)
        return mlp.down_proj(ops.silu_mul(mlp.gate_up(h))), residual


def step_ops_for(dtype: torch.dtype, device: torch.device):
    """The module whose three calls run a plain layer's elementwise stages on `device` (`_small_step`), or None."""
    for ops in (layer_ops, triton_layer_ops):
        if ops.usable(dtype, device):
            return ops
    return None


def prepare_fused(parts: list[nn.Linear], quantization: str) -> Linear | None:
    """`parts` fused into one linear layer (`fuse_linears`), quantised (`int8`, `int4`) with the parts' rows
    sharing its weight and scales, its kernel picked. Kept GGUF weights of different types cannot share one weight:
    side by side (`gguf_kept.fuse_kept`)."""
    if not gguf_kept.same_type(parts):
        return gguf_kept.fuse_kept(parts)
    fused = fuse_linears(parts)
    if quantization != "none":
        quantize_projection(fused, quantization)
        share_rows(fused, parts)
    fused.prepare()
    return fused


def prepare_single(lin: Linear, quantization: str, down: bool = False) -> None:
    """`lin` quantised and its kernel picked; `down`: an MLP's (or expert's) down projection, which stays int8 under
    int4 (`quantize.py`: the layer int4 costs most accuracy in)."""
    from ringsched.kernels.quantize import quantize_projection

    quantize_projection(lin, "int8" if down and quantization == "int4" else quantization)
    lin.prepare()


class MissingLayer(nn.Identity):
    """Placeholder for a layer another stage owns: no parameters, never called."""
