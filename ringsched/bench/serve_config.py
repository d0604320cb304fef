"""`bench serve`'s settings: `ServeConfig` (one run, checked where it is built) and the flags that make it
(names and defaults after `vllm bench serve`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from ringsched.bench.datasets import DATASETS

DEFAULT_BASE_URL = "http://127.0.0.1:30000"
# As vLLM's client: at saturation a request may wait in the server's queue for a long time, and a client
# timeout would turn queueing delay (which the benchmark is there to measure) into failures.
REQUEST_TIMEOUT_S = 6 * 60 * 60


@dataclass(frozen=True)
class ServeConfig:
    """One benchmark run. Field names match the flags (`--num-prompts` is `num_prompts`)."""

    base_url: str = DEFAULT_BASE_URL
    model: str | None = None
    num_prompts: int = 1000
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_vocab_size: int = 10000
    shared_prefix_len: int = 1000
    shared_prefix_groups: int = 1
    ignore_eos: bool = False
    seed: int = 0
    api_key: str | None = None
    save_result: str | None = None
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 requests/s (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0 (1.0 is Poisson), got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE (one JSON request per line)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        # Other subcommands' flags may share the namespace; take only ours.
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @property
    def completions_url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/completions"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` flags (names and defaults follow `vllm bench serve`)."""
    d = ServeConfig()
    add = parser.add_argument
    add("--base-url", default=d.base_url, help="server root; requests go to {base-url}/v1/completions")
    add("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    add("--num-prompts", type=int, default=d.num_prompts)
    add("--request-rate", type=float, default=d.request_rate, help="requests/s; inf sends all at once")
    add(
        "--burstiness",
        type=float,
        default=d.burstiness,
        help="gamma shape of inter-arrival times: 1.0 is Poisson, lower is burstier, higher is steadier",
    )
    add("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    _add_dataset_args(parser, d)
    add("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    add("--seed", type=int, default=d.seed)
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    add("--save-result", default=None, metavar="FILE", help="write the result dict as JSON")
    add("--disable-tqdm", action="store_true", help="no progress bar")


def _add_dataset_args(parser: argparse.ArgumentParser, d: ServeConfig) -> None:
    """The requests' prompts and lengths."""
    add = parser.add_argument
    add(
        "--dataset",
        choices=DATASETS,
        default=d.dataset,
        help="random: random token ids; shared-prefix: random "
        "prompts that start with one of --shared-prefix-groups random prefixes of --shared-prefix-len tokens (a "
        "system prompt), then --random-input-len tokens of their own; copy: a passage of about --random-input-len "
        "tokens to be repeated or lightly edited (where speculative decoding pays); jsonl: --dataset-path",
    )
    add("--dataset-path", default=None, help='JSONL file, one {"prompt": ..., "output_len": N} per line')
    add("--random-input-len", type=int, default=d.random_input_len)
    add("--random-output-len", type=int, default=d.random_output_len)
    add(
        "--random-range-ratio",
        type=float,
        default=d.random_range_ratio,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    add(
        "--random-vocab-size",
        type=int,
        default=d.random_vocab_size,
        help="random prompt token ids are drawn below this (the model's vocabulary size or less)",
    )
    add("--shared-prefix-len", type=int, default=d.shared_prefix_len, help="shared-prefix: tokens of each prefix")
    add(
        "--shared-prefix-groups",
        type=int,
        default=d.shared_prefix_groups,
        help="shared-prefix: distinct prefixes, the requests spread over them in turn",
    )
