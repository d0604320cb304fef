"""What an engine runs, resolved once: the model's directory and config, its end-of-sequence ids, the context
length and the layer partition. Built by `ModelSpec.resolve(cfg)` where the engine starts (the launcher, the
offline `Engine`) and passed, as a value, to the server, the supervisor and every stage; `auto` partitions are
decided by node 0's supervisor, which hands the stages `spec.with_partition(decided)`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ringsched.config import ConfigError, EngineConfig
from ringsched.layout.partition import default_partition, head_layers
from ringsched.models.checkpoint_check import check_checkpoint
from ringsched.refusals import REFUSALS
from ringsched.weights.fetch import resolve_model
from ringsched.weights.gguf_weights import check_kept
from ringsched.weights.model_config import ModelConfig
from ringsched.weights.model_files import check_tokenizer, read_config
from ringsched.weights.tp_shard import TPLayoutError, check_tp


@dataclass(frozen=True)
class ModelSpec:
    model_dir: str
    config: ModelConfig
    context_len: int  # --max-model-len, or the model's
    eos_ids: tuple[int, ...]
    partition: tuple[int, ...]  # layers per stage (with `auto`: the default split until node 0 has measured)

    @classmethod
    def resolve(cls, cfg: EngineConfig, quiet: bool = True) -> ModelSpec:
        """Fetch the model if needed and check the flags against it; raises ConfigError, FetchError,
        UnsupportedModelError, BadModelError or FileNotFoundError with a message naming the flag or the file."""
        model_dir = str(resolve_model(cfg.model, quiet=quiet))
        read_config(Path(model_dir))  # the files before anything reads them: one line per fault (BadModelError)
        check_tokenizer(Path(model_dir))
        mcfg = ModelConfig.from_dir(model_dir)
        check_checkpoint(model_dir, mcfg)  # nothing loads silently wrong
        head = head_layers(mcfg)
        cfg.check_partition(mcfg.num_layers, head)  # a bad --pp-layer-partition fails here, not in a child
        try:
            check_tp(mcfg, cfg.tp_size)
        except TPLayoutError as e:
            raise ConfigError(str(e)) from None
        if cfg.quantization == "gguf":
            try:
                check_kept(Path(model_dir), mcfg, cfg.tp_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if cfg.cp_size > 1 and (mcfg.layer_types or mcfg.attn_softcap):
            raise ConfigError(REFUSALS["cp+sliding"].message(cp=cfg.cp_size, arch=mcfg.architecture))
        if cfg.pp_flex_layers and mcfg.has_sliding:
            raise ConfigError(REFUSALS["flex+sliding"].message(flex=cfg.pp_flex_layers, arch=mcfg.architecture))
        auto = cfg.auto_partition
        counts = default_partition(mcfg.num_layers, cfg.pp_size, head) if auto else cfg.partition(mcfg.num_layers, head)
        return cls(
            model_dir, mcfg, cfg.context_len(mcfg.max_position_embeddings), _eos_ids(model_dir, mcfg), tuple(counts)
        )

    def with_partition(self, counts: list[int] | tuple[int, ...]) -> ModelSpec:
        return dataclasses.replace(self, partition=tuple(counts))


def _eos_ids(model_dir: str, mcfg: ModelConfig) -> tuple[int, ...]:
    """The config's end-of-sequence ids and those of generation_config.json (chat models often add one there)."""
    ids = set(mcfg.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
