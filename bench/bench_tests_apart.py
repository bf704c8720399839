"""What running a verifier's tests apart from the agent costs (issue 43), against the tests in the agent's context.

``--verifier command`` runs the tests apart (``Sandbox.run_tests``: the static helper's supervisor, a grading
folder, ``$HERMES_RUN_UNTRUSTED``); ``--verifier command:apart=false`` runs them as before, as the agent, in its
working folder.  The same run (one tool call per prompt, tests that run the agent's code through
``$HERMES_RUN_UNTRUSTED``, which is ``env`` with apart=false) with each, alternated ``--rounds`` times after a
first small run that is not counted (it converts the image, builds the helper): per sample, the difference of
the medians of the runs' wall time, the CPU of the run's process tree, and the CPU of the container engine's
processes (where the test rig runs Apptainer in a Docker container, its runtime is counted there), and the
verifier's own time (median of the samples).

    python bench/bench_tests_apart.py --sandbox singularity [--reuse none,namespace] [--prompts 20] [--workers 4] [--rounds 2]
    python bench/bench_tests_apart.py --sandbox local
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_docker import EngineCPU
from common import measure_run, model_server, write_prompts

# Tests as issue 43 has them: the agent's code through the runner, the hidden files' folder.
TESTS = '"$HERMES_RUN_UNTRUSTED" sh -c "test -n ok" && test -d "$HERMES_TESTS_DIR"'


def one_run(url: str, sandbox: str, count: int, workers: int, options: list, apart: bool) -> tuple:
    """(measure_run's figures with the engine's CPU, the verifier's time of each sample) of one run."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:  # /tmp: the test rig's Apptainer sees it too
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", count, tests=TESTS)
        with EngineCPU() as engine:
            measured = measure_run([
                "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", "bench",
                "--output_dir", tmp, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
                "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", sandbox,
                "--no-progress", "--seed", "1", *options, "--verifier", "command" if apart else "command:apart=false",
            ])
        records = [json.loads(line) for line in (Path(tmp) / "bench" / "trajectories.jsonl").open()]
    assert len(records) == count and all(r["metadata"]["passed"] for r in records), "a sample did not pass its test"
    return {**measured, "engine_s": engine.seconds}, [
        json.loads(r["metadata"]["verifiers"])[0]["duration_s"] for r in records]


def compare(sandbox: str, prompts: int, workers: int, options: list, rounds: int) -> None:
    results, durations = {False: [], True: []}, {False: [], True: []}
    with model_server(0.02, tool_calls=1) as url:
        one_run(url, sandbox, 2, workers, options, False)  # not counted
        for apart in (False, True) * rounds:  # alternated, so the machine's other work falls on both
            measured, times = one_run(url, sandbox, prompts, workers, options, apart)
            results[apart].append(measured)
            durations[apart] += times
    print(f"{sandbox} {' '.join(options[-2:])}: {prompts} samples, {workers} workers, {rounds} run(s) each, "
          "medians; apart=false -> apart, per sample")
    for key, label in (("wall_s", "wall"), ("cpu_s", "CPU, the run's process tree"), ("engine_s", "CPU, the engine")):
        before, after = (statistics.median(r[key] for r in results[apart]) for apart in (False, True))
        print(f"  {label:<28} {before:7.2f} s -> {after:7.2f} s: {1000 * (after - before) / prompts:+7.1f} ms")
    medians = {apart: 1000 * statistics.median(values) for apart, values in durations.items()}
    print(f"  the verifier's own time      {medians[False]:7.0f} ms -> {medians[True]:7.0f} ms (median of the samples)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandbox", default="singularity", help="local or singularity (the busybox test image)")
    parser.add_argument("--reuse", default="none", help="-S reuse= of the singularity runs, comma-separated")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each kind (alternated)")
    args = parser.parse_args()
    if args.sandbox != "singularity":
        compare(args.sandbox, args.prompts, args.workers, [], args.rounds)
        return
    from bench_singularity import ensure_runtime, make_archive

    ensure_runtime()
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        archive = make_archive(Path(folder))
        for reuse in args.reuse.split(","):
            compare("singularity", args.prompts, args.workers, [
                "-S", f"image=docker-archive://{archive}", "-S", f"cache_dir={folder}/cache", "-S", f"reuse={reuse}",
            ], args.rounds)


if __name__ == "__main__":
    main()
