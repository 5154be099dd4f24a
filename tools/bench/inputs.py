"""``parlay bench``'s input checks: every option that cannot run is refused in one line (exit
status 2) before anything is measured or written, never with a traceback or a long wait."""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import NoReturn

__all__ = ["OneLineParser", "check_inputs", "RATES"]

#: Link rates a simulated net may have, bits/s: below 10 Mbit/s one step of the suite's model
#: takes over ten seconds; above 100 Gbit/s no veth pair shaped by tc keeps up.
RATES = (10e6, 100e9)


class OneLineParser(argparse.ArgumentParser):
    """Bad input ends in one line naming it and the fix (exit status 2), no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"parlay bench: {message}. Hint: parlay bench --help lists the options.\n"
                  if message.startswith(("argument", "the following")) else
                  f"parlay bench: {message}\n")


def check_inputs(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse, in one line each, what cannot run: before anything is measured or written."""
    hint = "Hint: --from the results.json an earlier parlay bench --out wrote"
    if ns.source:
        try:
            with open(ns.source) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"--from {ns.source} cannot be read as JSON "
                     f"({e.strerror if isinstance(e, OSError) else e}). {hint}")
        if not (isinstance(doc, dict) and isinstance(doc.get("points"), list)):
            ap.error(f"--from {ns.source} is not a parlay bench results.json (no 'points' "
                     f"list). {hint}")
    else:
        _check_run(ap, ns)
    if os.path.exists(ns.out) and not os.path.isdir(ns.out):
        ap.error(f"--out {ns.out} is a file; it must be a folder (results.json, report.md and "
                 "the plots go there). Hint: --out bench-results")
    try:
        os.makedirs(ns.out, exist_ok=True)
        if not os.access(ns.out, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
    except OSError as e:
        ap.error(f"--out {ns.out} cannot be written ({e.strerror or e}). Hint: a folder of "
                 "yours, e.g. --out ./bench-results")


def _check_run(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """The options of a measuring run: links, counts, MNIST folder, compressors."""
    from parlay.compress import get_compressor
    from parlay.errors import ConfigError
    from tools.bench.accuracy import FILES, split_specs
    from tools.cluster import parse_rate

    nets = [n.strip() for n in ns.net.split(",") if n.strip()]
    if not nets:
        ap.error(f"--net needs at least one link, got {ns.net!r}. Hint: --net loopback")
    for n in nets:
        try:
            bps = parse_rate(n) if n not in ("loopback", "unshaped") else RATES[0]
        except ValueError:
            ap.error(f"--net takes loopback, unshaped or a rate like 100mbit or 1gbit, got {n!r}")
        if not RATES[0] <= bps <= RATES[1]:
            ap.error(f"--net {n}: a simulated link runs at 10mbit to 100gbit. Hint: --net 100mbit")
    for flag, v, low in (("--steps", ns.steps, 1), ("--budget", ns.budget, 0.001),
                         ("--accuracy-samples", ns.accuracy_samples, 1)):
        if v is not None and not low <= v < math.inf:
            ap.error(f"{flag} must be a number >= {low:g}, got {v}. Hint: drop {flag} for the "
                     "default")
    data = ns.data or os.environ.get("PARLAY_DATA_DIR")
    missing = [f for pair in FILES.values() for f in pair
               if data and not os.path.isfile(os.path.join(data, f))]
    if missing and not ns.no_accuracy:
        ap.error(f"--data {data} (or PARLAY_DATA_DIR) lacks {', '.join(missing)}. Hint: drop "
                 "both for parlay's own copy of MNIST, or add --no-accuracy")
    for c in split_specs(ns.compressors or ""):
        try:
            get_compressor(c)
        except ConfigError as e:
            ap.error(f"--compressors: {e}")
