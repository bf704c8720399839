"""What a command verifier's tests cost per sample in the docker sandbox, apart from the agent or in its context.

For each mode (the strict one, a container per prompt with ``-S pool=auto``, and ``-S reuse=namespace``), the same
run of ``--prompts`` prompts (one terminal command each) three times: without a verifier, with
``--verifier command:apart=false`` (the tests as the agent, in its working folder: the path before issue 43) and
with ``--verifier command`` (Sandbox.run_tests: the agent's identity read, the helper copied in or started in the
view, the tests under its supervisor as the container's root).  The test is one line that runs the agent's code
through ``$HERMES_RUN_UNTRUSTED`` (``env`` with apart=false) and has a hidden file.  Per sample, beside the run
without a verifier: wall time, the CPU of the run's process tree, the engine's CPU (dockerd, containerd, the shims
and what they reap; the engine may be shared, so others' work in the window counts too), and the verifier's own
time (its entry's ``duration_s``).

    python bench/bench_docker_grading.py [--prompts 40] [--workers 8] [--rounds 2] [--modes strict,reuse]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_docker import EngineCPU
from common import measure_run, model_server, write_prompts

IMAGE = "hermes-batch-test/busybox-a:1"
TESTS = 'test "$("$HERMES_RUN_UNTRUSTED" cat "$HERMES_TESTS_DIR/expected")" = ok'
MODES = {"strict": ["-S", "pool=auto"], "reuse": ["-S", "reuse=namespace"]}
VERIFIERS = (None, "command:apart=false", "command")


def one_run(mode: str, verifier, prompts: int, workers: int, url: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", prompts, tests=TESTS, test_files={"expected": "ok"})
        extra = ["--verifier", verifier] if verifier else []
        with EngineCPU() as engine:
            result = measure_run([
                "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", "bench",
                "--output_dir", tmp, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
                "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", "docker",
                "-S", f"image={IMAGE}", *MODES[mode], "--no-progress", "--seed", "1", *extra,
            ])
        result["engine_s"] = engine.seconds
        result["verify_s"] = None
        if verifier:
            records = [json.loads(line) for line in (Path(tmp) / "bench" / "trajectories.jsonl").open()]
            assert len(records) == prompts and all(r["metadata"]["passed"] for r in records), "a sample failed"
            durations = [json.loads(r["metadata"]["verifiers"])[0]["duration_s"] for r in records]
            result["verify_s"] = statistics.mean(durations)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="each run this many times, interleaved; medians")
    parser.add_argument("--modes", default="strict,reuse")
    args = parser.parse_args()
    with model_server(0.02, tool_calls=1) as url:
        for mode in args.modes.split(","):
            found = {verifier: [] for verifier in VERIFIERS}
            for _ in range(args.rounds):
                for verifier in VERIFIERS:
                    found[verifier].append(one_run(mode, verifier, args.prompts, args.workers, url))
            median = {verifier: {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "verify_s"}
                      for verifier, runs in found.items()}
            base = median[None]
            print(f"docker {mode}: {args.prompts} samples, {args.workers} workers, medians of {args.rounds} rounds")
            print(f"  no verifier: wall {base['wall_s']:.2f} s, run CPU {base['cpu_s']:.2f} s, "
                  f"engine CPU {base['engine_s']:.2f} s")
            for verifier in VERIFIERS[1:]:
                row = median[verifier]
                own = statistics.median(r["verify_s"] for r in found[verifier])
                per = {key: 1000 * (row[key] - base[key]) / args.prompts for key in ("wall_s", "cpu_s", "engine_s")}
                print(f"  --verifier {verifier}: per sample {per['wall_s']:+.0f} ms wall, {per['cpu_s']:+.1f} ms run "
                      f"CPU, {per['engine_s']:+.1f} ms engine CPU; the verifier's own time {1000 * own:.0f} ms")


if __name__ == "__main__":
    main()
