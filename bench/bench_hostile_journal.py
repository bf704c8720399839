"""The peak memory and time of a --resume over a hostile responses.jsonl of about 1 GB.

Issue 45 asks for it: the replay journal may be edited between a kill and the resume.
A finished run of 20 prompts gets a responses.jsonl made of what a hostile file can
hold: one line of 300 MB (longer than any answer), one nested 200,000 levels deep,
lines that are not JSON, lines of the wrong types, and for the rest answer lines of
the right shape for prompts of no row (each about 200 bytes; a resume keeps at most
1,000,000 of them, skips the rest).  Then `hermes-batch run --resume` runs as a child
process and its peak resident memory (VmHWM) and wall time are printed.

    python bench/bench_hostile_journal.py [--size_mb 1024] [--code /path/to/other/checkout]

``--code`` runs the resume with the hermes_batch package of another checkout (its
folder put first on PYTHONPATH), to compare with the code before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import model_server, write_prompts

MB = 1 << 20


def hermes(args: list[str], code: str | None = None) -> dict:
    """Run ``hermes-batch`` as a child; its exit status, wall time, peak resident memory and stderr."""
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hermes_batch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=code or None)
    peak = 0
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.02)
    _out, err = proc.communicate()
    return {"code": proc.returncode, "wall_s": time.perf_counter() - started, "peak_mb": peak / 1024, "err": err}


def answer_line(key: str, request: str) -> bytes:
    answer = {"m": ["assistant", "ok", None, [], None, None, None], "u": [1, 1, 0, 0, None], "f": "stop",
              "p": None, "model": "m"}
    return json.dumps({"p": key, "h": request, "r": answer}, separators=(",", ":")).encode() + b"\n"


def hostile_journal(path: Path, size: int) -> dict:
    """Write about ``size`` bytes of hostile lines to ``path``; what went in."""
    made = {"long line": 0, "deep line": 0, "not JSON": 0, "wrong types": 0, "answers": 0}
    with open(path, "wb") as out:
        out.write(b'{"p":"long","h":"h","r":{"m":["assistant","')
        chunk = b"x" * MB
        for _ in range(300):
            out.write(chunk)
        out.write(b'",null,[],null,null,null],"u":[0,0,0,0,null]}}\n')
        made["long line"] += 1
        out.write(b"[" * 200_000 + b"]" * 200_000 + b"\n")
        made["deep line"] += 1
        for n in range(1000):
            out.write(os.urandom(100).replace(b"\n", b" ") + b"\n")
            out.write(b'{"p":["x"],"h":"aa","r":{}}\n')
            made["not JSON"] += 1
            made["wrong types"] += 1
        n = 0
        while out.tell() < size:
            lines = b"".join(answer_line(f"{n + k:032x}", f"{n + k:032x}") for k in range(1000))
            out.write(lines)
            n += 1000
        made["answers"] = n
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size_mb", type=int, default=1024)
    parser.add_argument("--code", help="a checkout whose hermes_batch runs the resume (default: this one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, model_server(0.0) as url:
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", 20)
        base = ["run", "--dataset_file", str(dataset), "--batch_size", "10", "--base_url", url, "--model", "bench-model",
                "--api_key", "bench", "--num_workers", "8", "--distribution", "terminal_only", "--no-progress",
                "--seed", "1", "--output_dir", str(Path(tmp) / "out"), "--run_name", "r"]
        first = hermes(base)
        if first["code"] != 0:
            raise SystemExit(first["err"][-4000:])
        journal = Path(tmp) / "out" / "r" / "responses.jsonl"
        made = hostile_journal(journal, args.size_mb * MB)
        size = journal.stat().st_size
        print(f"responses.jsonl: {size / MB:.0f} MB: " + ", ".join(f"{n:,} {what}" for what, n in made.items()))
        result = hermes([*base, "--resume"], args.code)
        skipped = [line for line in result["err"].splitlines() if "skipped" in line and "responses.jsonl" in line]
        print(f"--resume: exit {result['code']}, peak {result['peak_mb']:.0f} MB, wall {result['wall_s']:.1f} s")
        for line in skipped[:3]:
            print("  " + line.strip()[:300])
        if result["code"] != 0:
            print(result["err"][-2000:])


if __name__ == "__main__":
    main()
