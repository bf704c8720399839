"""The regex worker's child process (regex_worker.py): ``re.search`` for each request on its input, until it ends.

Run as a script (``python -I -S regex_child.py PARENT_PID``), so it imports nothing but the standard library
it needs.
Each request and reply is a 4-byte big-endian length and that many bytes of JSON: the request
``{"pattern": ..., "text": ...}``, the reply ``{"match": true|false}`` or ``{"error": "..."}``.
"""

import json
import os
import re
import signal
import struct
import sys


def _die_with_parent(parent: int) -> None:
    """A match that runs for hours must not outlive the run that asked for it (Linux: PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it ended before the signal was asked for
        sys.exit(0)


def _answer(request: dict) -> dict:
    try:
        return {"match": re.search(request["pattern"], request["text"]) is not None}
    except re.error as exc:
        return {"error": f"not a valid regular expression ({exc})"}
    except (RecursionError, MemoryError, OverflowError, TypeError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run decides when this process ends (Ctrl-C reaches it too)
    _die_with_parent(int(sys.argv[1]))
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = source.read(4)
        if len(head) < 4:  # the run closed its end
            return
        (size,) = struct.unpack(">I", head)
        reply = json.dumps(_answer(json.loads(source.read(size)))).encode()
        sink.write(struct.pack(">I", len(reply)) + reply)
        sink.flush()


if __name__ == "__main__":
    main()
