"""What the launcher says once this node's ranks are ready: the dtype `auto` chose where it is not the checkpoint's,
each rank's layers, weights, KV pool, threads and CPUs,
then what the pools allow a request (the smallest pool's tokens against the context length)."""

from __future__ import annotations

import logging

from ringsched.config import EngineConfig
from ringsched.device import dtype_note, read_checkpoint_config
from ringsched.stage.affinity import cpu_list

logger = logging.getLogger("ringsched.launch")


def log_ready(cfg: EngineConfig, info: dict[int, dict], context_len: int) -> None:
    if cfg.dtype == "auto":
        device = cfg.resolved_device
        note = dtype_note(str(cfg.torch_dtype).removeprefix("torch."), device, read_checkpoint_config(cfg.model))
        if note:
            logger.info(note)
    for rank in sorted(info):
        i = info[rank]
        logger.info(
            "%s ready: layers %d-%d, weights %.1f MiB, KV %d tokens, %d thread(s) on CPUs %s (pid %d)",
            cfg.describe_rank(rank),
            i["layers"][0],
            i["layers"][1] - 1,
            i["weights_bytes"] / 2**20,
            i["kv_tokens"],
            i["threads"],
            cpu_list(i["cpus"]),
            i["pid"],
        )
    if not info:
        return
    kv = min(i.get("request_kv_tokens", i["kv_tokens"]) for i in info.values())
    if kv >= context_len:
        logger.info(
            "KV pools: a request may hold %d tokens (--max-model-len %d), %.1f requests of that length at once",
            context_len,
            context_len,
            kv / context_len,
        )
    else:
        logger.warning(
            "KV pools: a request may hold %d tokens, less than --max-model-len %d: a longer prompt plus "
            "output is refused; raise --kv-cache-memory or lower --max-model-len to %d",
            kv,
            context_len,
            kv,
        )
