"""Run the Modal stand-in on its own: ``python -m standin [--prewarm IMAGE COUNT]``, with ``hermes_batch_modal/tests`` on sys.path.

Prints ``READY <url> <token id> <token secret>`` and serves until its standard input
closes; then terminates its sandboxes and prints its statistics as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

from . import ModalStandIn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prewarm", nargs=2, metavar=("IMAGE", "COUNT"), help="containers to start before serving")
    args = parser.parse_args()
    standin = ModalStandIn().start()
    if args.prewarm:
        standin.prewarm(args.prewarm[0], int(args.prewarm[1]))
    print("READY", standin.url, standin.token_id, standin.token_secret, flush=True)
    try:
        sys.stdin.read()
    finally:
        stats = {
            "sandboxes": len(standin.sandboxes),
            "peak_running": standin.peak_running,
            "peak_starting": standin.peak_starting,
            "throttled": standin.throttled,
            "execs": standin.exec_count,
            "calls": dict(standin.calls),
        }
        standin.stop()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats["cpu_s"] = usage.ru_utime + usage.ru_stime
        print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
