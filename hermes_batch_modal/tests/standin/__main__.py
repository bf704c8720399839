"""Run the Modal stand-in on its own: ``python -m standin`` (with ``hermes_batch_modal/tests`` on sys.path).

Prints ``READY <url> <token id> <token secret>`` and serves until its standard input
closes; then terminates its sandboxes and prints its statistics as one JSON line.
"""

from __future__ import annotations

import json
import resource
import sys

from . import ModalStandIn


def main() -> None:
    standin = ModalStandIn().start()
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
