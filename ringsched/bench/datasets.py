"""Benchmark request datasets: random token-id prompts, random prompts behind shared prefixes, passages to be
repeated or lightly edited (where speculative decoding pays), or prompts read from a JSONL file.

Contract: each loader returns exactly `num_prompts` `SampleRequest`s, deterministic for a given seed.
A prompt is either a string or a list of token ids (the OpenAI completions API accepts both); `prompt_len`
is the input token count when the client knows it (token ids, or a `prompt_len` field in the file) and
`None` when only the server can tell (the client then takes it from the response's usage).
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Low ids are where tokenizers keep special and control tokens; random prompts stay above them so that a
# random prompt never contains an EOS or a chat-template marker.
SPECIAL_TOKEN_IDS = 1000
DATASETS = ("random", "shared-prefix", "copy", "jsonl")
# Where `copy` passages come from: the standard library's module docstrings (English prose, offline, fixed for a
# Python version)
PASSAGE_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "decimal",
    "difflib",
    "doctest",
    "fractions",
    "functools",
    "heapq",
    "inspect",
    "json",
    "logging",
    "optparse",
    "pathlib",
    "pickle",
    "pydoc",
    "random",
    "re",
    "sched",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "tokenize",
    "typing",
    "unittest",
    "uuid",
    "zipfile",
)
WORDS_PER_TOKEN = 0.75  # English prose, BPE tokenizers: about 4 tokens to 3 words


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt, its length in tokens if known, and the `max_tokens` to ask for."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive `[low, high]` for `--random-range-ratio`, as vLLM computes it (never below 1)."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return low, high


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 10000,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random token ids in `[offset, vocab_size)`, lengths uniform in the range-ratio window.

    `vocab_size` is the model's vocabulary size (ids at or past it would be rejected by the server); the
    offset skips the special-token ids, shrinking for the tiny vocabularies of test models.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if vocab_size < 2:
        raise ValueError(f"--random-vocab-size must be at least 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offset = min(SPECIAL_TOKEN_IDS, vocab_size // 2)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        ids = rng.integers(offset, vocab_size, size=int(n_in)).tolist()
        requests.append(SampleRequest(prompt=ids, prompt_len=len(ids), output_len=int(n_out)))
    return requests


def shared_prefix_requests(
    tails: list[SampleRequest], prefix_len: int, groups: int, vocab_size: int = 10000, seed: int = 0
) -> list[SampleRequest]:
    """`tails` (token-id prompts, as `random_requests` makes them) each behind one of `groups` random prefixes of
    `prefix_len` tokens (request `i` behind prefix `i % groups`): many users behind one system prompt."""
    if prefix_len < 1 or groups < 1:
        raise ValueError("--shared-prefix-len and --shared-prefix-groups must be at least 1")
    rng = np.random.default_rng(seed + 1)
    offset = min(SPECIAL_TOKEN_IDS, vocab_size // 2)
    prefixes = [rng.integers(offset, vocab_size, size=prefix_len).tolist() for _ in range(groups)]
    out = []
    for i, t in enumerate(tails):
        ids = prefixes[i % groups] + list(t.prompt)
        out.append(SampleRequest(prompt=ids, prompt_len=len(ids), output_len=t.output_len))
    return out


def copy_requests(num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Prompts that give a passage of about `input_len` tokens (standard-library documentation) and ask for it
    repeated word for word, or (every other request) repeated with one word replaced: output that mostly copies
    its prompt, as summaries of a given text, edits and code with repeated identifiers do."""
    if input_len < 8 or output_len < 1:
        raise ValueError("--dataset copy needs --random-input-len >= 8 and --random-output-len >= 1")
    words = " ".join((importlib.import_module(m).__doc__ or "") for m in PASSAGE_MODULES).split()
    n = min(len(words), max(8, round(input_len * WORDS_PER_TOKEN)))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_prompts):
        start = int(rng.integers(0, len(words) - n + 1))
        passage = " ".join(words[start : start + n])
        if i % 2:
            old = max(words[start : start + n], key=len)
            ask = f"Repeat the passage above word for word, but write {old.upper()} wherever it says {old}."
        else:
            ask = "Repeat the passage above word for word."
        prompt = f"Passage:\n\n{passage}\n\n{ask}\n\n"
        out.append(SampleRequest(prompt=prompt, prompt_len=None, output_len=output_len))
    return out


def jsonl_requests(path: str | Path, num_prompts: int) -> list[SampleRequest]:
    """The first `num_prompts` lines of a JSONL file, repeated in order if the file has fewer.

    Each line is `{"prompt": str | list[int], "output_len": int}`, optionally with `"prompt_len": int`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path} does not exist; pass a JSONL file of prompts")
    samples = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                samples.append(_parse_line(line, f"{path}:{lineno}"))
    if not samples:
        raise ValueError(f"--dataset-path {path} has no requests; each line needs a prompt and output_len")
    return [samples[i % len(samples)] for i in range(num_prompts)]


def _parse_line(line: str, where: str) -> SampleRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from e
    prompt, output_len = row.get("prompt"), row.get("output_len")
    is_ids = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) or is_ids):
        raise ValueError(f'{where}: "prompt" must be a string or a list of token ids')
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f'{where}: "output_len" must be a positive integer, got {output_len!r}')
    prompt_len = row.get("prompt_len", len(prompt) if is_ids else None)
    return SampleRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len)
