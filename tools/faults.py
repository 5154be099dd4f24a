"""Fault injection anyone can run: every failure parlay promises to notice, tried for real.

Each case family lives in :mod:`tools.fault_cases` (``run(repeats, workdir) -> rows``); this
script runs the ones asked for, prints a row per try and a summary per case, and exits non-zero
when any try did not end as promised. Not part of the test suite: a full run takes minutes.

    python tools/faults.py                       # every family, the issue's repeat counts
    python tools/faults.py corrupt --repeats 10  # one family, fewer tries
    python tools/faults.py --json faults.json    # the rows as JSON too
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

#: Case families and the tries each makes by default (the counts issue 25 asks for).
FAMILIES = {"corrupt": 100, "same_run_id": 20, "replica_flip": 20, "ps_loss": 3, "errors": 1,
            "diloco_kill": 6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("families", nargs="*", metavar="FAMILY",
                   help=f"case families to run (default: all of {', '.join(FAMILIES)})")
    p.add_argument("--repeats", type=int, default=None,
                   help="tries per family (default: each family's own count)")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON")
    args = p.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown case family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    os.environ.setdefault("PARLAY_TIMEOUT", "60")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="parlay-faults-") as tmp:
        for family in args.families or list(FAMILIES):
            module = importlib.import_module(f"tools.fault_cases.{family}")
            t0 = time.perf_counter()
            got = module.run(args.repeats or FAMILIES[family], Path(tmp) / family)
            for row in got:
                row.setdefault("family", family)
                print(f"{'ok  ' if row['ok'] else 'FAIL'} {family}/{row['case']}: {row['detail']}",
                      flush=True)
            print(f"-- {family}: {sum(bool(r['ok']) for r in got)}/{len(got)} as promised "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            rows += got
    by_case: dict[str, list[bool]] = collections.defaultdict(list)
    for row in rows:
        by_case[f"{row['family']}/{row['case']}"].append(bool(row["ok"]))
    print("\nsummary")
    for case, oks in by_case.items():
        print(f"  {case:<40} {sum(oks):>4}/{len(oks)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1, default=str))
    return 0 if all(bool(r["ok"]) for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tools` as a package
    sys.exit(main())
