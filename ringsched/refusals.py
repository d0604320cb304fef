"""The combinations ringsched refuses: two features that do not run together, why, and what to do instead.

Every refusal of one feature by another is raised from this table, by `config_checks.py` for flags against flags
and by `spec.py` for flags against the model, so the table is the whole matrix; `tests/test_refusals.py` turns on
every pair of features and checks that exactly the pairs named here are refused, with these messages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    features: tuple[str, str]  # as a user names them: flags, or what the model has
    template: str  # the message, its `{}` fields filled by `message`

    def message(self, **values: object) -> str:
        return self.template.format(**values)


REFUSALS = {
    "cp+tp": Refusal(
        ("--cp-size", "--tp-size"),
        "--cp-size {cp} with --tp-size {tp}: a stage is either tensor-parallel or context-parallel for now; pick one "
        "of them (and keep the other at 1)",
    ),
    "prefix+cp": Refusal(
        ("--enable-prefix-caching", "--cp-size"),
        "--enable-prefix-caching runs with --cp-size 1 only (got --cp-size {cp}): a cached prefix's blocks would have "
        "to sit on the context-parallel ranks its tokens are placed on; pass --no-enable-prefix-caching",
    ),
    "flex+pp": Refusal(
        ("--pp-flex-layers", "--pp-size"),
        "--pp-flex-layers moves the cut between two stages; it needs --pp-size 2 (got {pp}), or leave it at 0",
    ),
    "flex+cp": Refusal(
        ("--pp-flex-layers", "--cp-size"),
        "--pp-flex-layers runs with --cp-size 1 only (got --cp-size {cp}): a moving cut's mirrored KV rows are not "
        "split over context-parallel ranks; leave --pp-flex-layers at 0",
    ),
    "flex+tp": Refusal(
        ("--pp-flex-layers", "--tp-size"),
        "--pp-flex-layers runs with --tp-size 1 only (got --tp-size {tp}): a moving cut's mirrored KV rows are not "
        "sharded; leave --pp-flex-layers at 0 with tensor parallelism",
    ),
    "flex+cuda": Refusal(
        ("--pp-flex-layers", "--device cuda"),
        "--pp-flex-layers is for CPU stages for now: on CUDA its large K/V transfers go both ways on one NCCL "
        "communicator unbatched, which can deadlock; leave --pp-flex-layers at 0 with --device cuda",
    ),
    "cp+sliding": Refusal(
        ("--cp-size", "sliding-window or soft-capped layers"),
        "--cp-size {cp}: context parallelism runs full attention without soft-capping, and this {arch} has "
        "sliding-window or soft-capped layers; use --cp-size 1 (--pp-size and --tp-size split it)",
    ),
    "flex+sliding": Refusal(
        ("--pp-flex-layers", "sliding layers"),
        "--pp-flex-layers {flex}: a moving cut mirrors the pool's KV rows, and this {arch}'s sliding layers keep "
        "theirs in rings of their own; use --pp-flex-layers 0",
    ),
}
