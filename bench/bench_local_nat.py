"""What the local sandbox's network of its own costs: a prompt's start, and a fetch through the NAT.

For each network (host, and nat through each of pasta and slirp4netns that is
installed), one backend: ``--starts`` prompts opened one after another, each
running ``true`` and closed (wall and CPU of the whole process tree per prompt),
then one prompt fetching a body from an HTTP server on this machine's loopback
``--fetches`` times with curl (host: at 127.0.0.1; nat: at the namespace's
gateway, which -S host_loopback=true maps to it), per fetch.  Traffic stays on
this machine.

    python bench/bench_local_nat.py [--starts 20] [--fetches 50] [--bytes 1024,1048576]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hermes_batch.contract.run_context import RunContext
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.local_sandbox import launchers, nat
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig

GATEWAY = ("gw=$(awk '$2 == \"00000000\" { print $3 }' /proc/net/route | head -n 1); "
           "gw=$(printf '%d.%d.%d.%d' 0x${gw#??????} 0x$(echo $gw | cut -c5-6) 0x$(echo $gw | cut -c3-4) 0x${gw%??????}); ")


def cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def serve(body_sizes) -> tuple:
    bodies = {f"/{size}": b"x" * size for size in body_sizes}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = bodies.get(self.path, b"")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


async def measure(label: str, options: dict, starts: int, fetches: int, sizes, port: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        backend = LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("bench", Path(tmp) / "run", seed=0))
        await backend.start()
        try:
            before, began = cpu(), time.monotonic()
            for index in range(starts):
                sandbox = await backend.open(SandboxSpec("bench", index, f"{index:08d}feedface", commands=True))
                await sandbox.exec("true", 60)
                await sandbox.close()
            start_wall, start_cpu = (time.monotonic() - began) / starts, (cpu() - before) / starts
            line = f"{label:22} start {start_wall * 1000:6.1f} ms wall {start_cpu * 1000:5.1f} ms CPU"
            for size in sizes:
                sandbox = await backend.open(SandboxSpec("bench", 999, "99999999feedface", commands=True))
                address = "127.0.0.1" if options["network"] == "host" else "$gw"
                command = (f"{GATEWAY}for i in $(seq {fetches}); do curl -s -o /dev/null -w '%{{size_download}}\\n' "
                           f"http://{address}:{port}/{size}; done | sort -u")
                await sandbox.exec("true", 60)
                before, began = cpu(), time.monotonic()
                done = await sandbox.exec(command, 600)
                wall = (time.monotonic() - began) / fetches
                await sandbox.close()
                await asyncio.sleep(0.5)  # the NAT program's CPU is counted once it is reaped, after close
                used = (cpu() - before) / fetches
                assert done.output.strip() == str(size), done
                line += f" | fetch {size} B {wall * 1000:6.2f} ms wall {used * 1000:5.2f} ms CPU"
            print(line, flush=True)
        finally:
            await backend.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--fetches", type=int, default=50)
    parser.add_argument("--bytes", default="1024,1048576")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(size) for size in args.bytes.split(",")]
    server, port = serve(sizes)
    variants = [("host", {"network": "host"}, None)]
    variants += [(f"nat ({name})", {"network": "nat", "host_loopback": True}, name)
                 for name in nat.PROGRAMS if shutil.which(name)]
    try:
        for _ in range(args.rounds):  # alternated: the machine is shared, only side-by-side figures compare
            for label, options, program in variants:
                if program is not None:
                    nat.PROGRAMS = (program,)
                    launchers._nats.clear()
                asyncio.run(measure(label, options, args.starts, args.fetches, sizes, port))
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
