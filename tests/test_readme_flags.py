"""The README's flag table is the launcher's `--help` in prose: every flag is in it, with its default."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ringsched.launch import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"


def _table() -> dict[str, str]:
    """Flag -> its row's default cell, from the table under `## Flags`."""
    text = README.read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`--"):
            names = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
            defaults = [d.strip() for d in cells[1].split(",")] if len(names) > 1 else [cells[1]]
            for i, name in enumerate(names):
                rows[name] = defaults[i] if i < len(defaults) else cells[1]
    return rows


def _shown(default: object) -> str | None:
    """How a plain default reads in the table (None: a derived default the row describes in words)."""
    if default is None or isinstance(default, bool):
        return {True: "on", False: "off"}.get(default) if isinstance(default, bool) else None
    return f"{default:g}" if isinstance(default, float) else str(default)


def test_every_launcher_flag_is_in_the_readme_with_its_default():
    rows = _table()
    missing, wrong = [], []
    for action in build_parser()._actions:
        names = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if not names or isinstance(action, argparse._HelpAction):
            continue
        name = names[0]
        if name not in rows:
            missing.append(name)
            continue
        shown = _shown(action.default)
        if shown is not None and shown not in rows[name].replace("`", ""):
            wrong.append(f"{name}: README says {rows[name]!r}, --help {shown!r}")
    assert not missing, f"flags of `python -m ringsched.launch --help` missing from README.md's table: {missing}"
    assert not wrong, wrong
