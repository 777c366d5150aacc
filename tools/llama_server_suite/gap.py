#!/usr/bin/env python3
"""The acceptance gap: tests that pass on llama-server (the golden) but not on bloomery.

    python tools/llama_server_suite/gap.py BLOOMERY_RESULTS.json [--golden tests/golden/llama_server_suite_baseline.json]

Prints each gap test with bloomery's failure reason, grouped by reason, and the
refused-by-name ones apart. Pure functions; the pytest entry uses them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import selection  # noqa: E402


def gap(golden: dict, ours: dict) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(open gap [(nodeid, our failure)], refused by name [(nodeid, why)]) over tests that ran on both."""
    open_gap, refused = [], []
    for nodeid, base in sorted(golden["tests"].items()):
        mine = ours["tests"].get(nodeid)
        if base["outcome"] != "passed" or mine is None or mine["outcome"] == "passed":
            continue
        why = selection.refused_reason(nodeid)
        if why is not None:
            refused.append((nodeid, why))
        else:
            open_gap.append((nodeid, mine.get("reason") or mine["outcome"]))
    return open_gap, refused


def reason_key(reason: str) -> str:
    """A failure reason with numbers and quoted values blurred, so alike failures group."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason))[:160]


def grouped(items: list[tuple[str, str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for nodeid, reason in items:
        groups[reason_key(reason)].append(nodeid)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--golden", type=Path, default=selection.GOLDEN)
    a = ap.parse_args()
    open_gap, refused = gap(json.loads(a.golden.read_text()), json.loads(a.results.read_text()))
    print(f"# gap: {len(open_gap)} tests pass on llama-server and fail on bloomery; {len(refused)} refused by name")
    for key, ids in grouped(open_gap).items():
        print(f"\n## {len(ids)} x {key}")
        for n in ids:
            print(f"  {n}")
    print("\n# refused by name")
    for n, why in refused:
        print(f"  {n}: {why}")


if __name__ == "__main__":
    main()
