"""``--executor ray``: the run's prompts on Ray actors spread over the nodes of a cluster.

The run's process is the driver: it alone writes the run folder, and leases
prompts to the actors as ``--executor processes`` does to its worker processes
(``hermes_batch.executors.dispatch``).  Each actor runs the prompt processor rebuilt from
the run's plan, so its sandboxes are created on the node it runs on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from typing import Awaitable, Callable, Iterator, Optional

import attrs

from hermes_batch import Executor, PromptJob, UsageError, WorkerLink, WorkerLost, run_on_workers

log = logging.getLogger("hermes_batch.ray")

PROBE_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 60.0  # for an actor to cancel its prompts and close their sandboxes before it is killed


def _at_least(minimum):
    def check(_instance, attribute, value) -> None:
        if value is not None and value < minimum:
            raise ValueError(f"{attribute.name} must be at least {minimum}, not {value}")

    return check


@attrs.frozen
class RayConfig:
    address: str = "auto"  # "auto" (RAY_ADDRESS, else the cluster started on this machine), HOST:PORT or ray://HOST:PORT
    workers: Optional[int] = attrs.field(default=None, validator=_at_least(1))  # None: one per node
    concurrency_per_worker: Optional[int] = attrs.field(default=None, validator=_at_least(1))  # None: --num_workers / workers
    num_cpus: float = attrs.field(default=1.0, validator=_at_least(0))  # CPUs each actor reserves on its node
    scratch_dir: Optional[str] = None  # where an actor's sandboxes keep their folders on its node (None: its temporary folder)


class RayExecutor(Executor):
    """Ray actors, one per node unless -E workers=N, share the run's sessions; the run's process writes the run folder."""

    name = "ray"
    description = "Ray actors over a cluster's nodes (-E address=auto|HOST:PORT|ray://..., -E workers=N, -E concurrency_per_worker=N)."
    Config = RayConfig

    def __init__(self, config):
        super().__init__(config)
        self._cluster: Optional[tuple] = None  # (alive nodes, CPUs) once connected

    async def start(self, processor) -> None:
        # Connecting takes a second or more: it happens beside the sandbox check and the preflight request,
        # and a cluster that cannot be reached stops the run before any prompt (at most the preflight is paid).
        if self._cluster is None:
            self._cluster = await asyncio.to_thread(connect, self.config.address)
        nodes, cpus = self._cluster
        workers = self.config.workers or nodes
        if workers * self.config.num_cpus > cpus:
            raise UsageError(
                f"{workers} Ray workers of {self.config.num_cpus:g} CPU each do not fit the cluster's {cpus:g} CPUs; "
                "pass fewer -E workers=N or a smaller -E num_cpus=X."
            )

    async def run(
        self,
        jobs: Iterator[PromptJob],
        processor,
        on_outcome: Callable[[PromptJob, object], Awaitable[None]],
        concurrency: int,
    ) -> None:
        cfg = self.config
        await self.start(processor)
        workers = cfg.workers or self._cluster[0]
        per_worker = cfg.concurrency_per_worker or max(1, math.ceil(concurrency / workers))

        async def start(setup, api_key):
            return RayLink.create(setup, api_key, cfg)

        await run_on_workers(start, [per_worker] * workers, jobs, processor, on_outcome)

    async def shutdown(self) -> None:
        if self._cluster is not None:
            import ray

            self._cluster = None
            await asyncio.to_thread(ray.shutdown)


def connect(address: str) -> tuple[int, float]:
    """Connect this process to the cluster at ``address``; (alive nodes, CPUs).  UsageError when it cannot."""
    _probe(address)  # before Ray's import, a second: an address that does not answer is told before the preflight
    import ray

    try:
        ray.init(address=address, namespace="hermes-batch", logging_level=logging.WARNING, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"Could not reach the Ray cluster at {address} ({first.rstrip('.')}); start one with 'ray start --head' "
            "or pass its address with -E address=HOST:PORT or -E address=ray://HOST:10001."
        ) from None
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    return len(nodes), float(ray.cluster_resources().get("CPU", 0.0))


def _probe(address: str) -> None:
    """Fail within seconds when an explicit HOST:PORT does not answer (ray.init would keep trying for a minute)."""
    target = address.removeprefix("ray://")
    if address == "auto" or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"Could not reach the Ray cluster at {address} ({exc}); start one with 'ray start --head' "
            "or pass the address 'ray start' printed with -E address=HOST:PORT."
        ) from None


class RayLink(WorkerLink):
    """The driver's end of one PromptActor."""

    def __init__(self, actor, index: int, concurrency: int):
        self.actor = actor
        self.started = False
        self.last: Optional[list] = None  # what the actor's stop returned, handed out by the next receive
        self.index = index
        self.concurrency = concurrency
        self.name = f"Ray worker {index + 1}"

    @classmethod
    def create(cls, setup, api_key: Optional[str], cfg: RayConfig) -> "RayLink":
        import ray

        from hermes_batch import PromptWorker  # the engine: loaded when a run starts, not with the plugin

        from .actor import PromptActor

        env = PromptWorker.environment(api_key)
        actor = ray.remote(PromptActor).options(
            num_cpus=cfg.num_cpus,
            scheduling_strategy="SPREAD",
            # the key reaches the actor in its environment only: the setup, stored by Ray, never holds it
            runtime_env={"env_vars": env} if env else None,
        ).remote(setup, cfg.scratch_dir)
        return cls(actor, setup.index, setup.concurrency)

    async def _start(self) -> None:
        import ray

        try:
            host, node = await self.actor.start.remote()
        except ray.exceptions.RayError as exc:
            raise WorkerLost(f"it could not start: {_first_line(exc)}") from None
        self.name = f"Ray worker {self.index + 1} on {host} (node {node[:8]})"

    async def send(self, message: tuple) -> None:
        import ray

        try:
            if message[0] == "lease":
                await self.actor.lease.remote(message[1])
            elif message[0] == "return":
                await self.actor.take_back.remote()
            elif message[0] == "batched":  # --batch_api: the driver's answer to a session's batch call
                await self.actor.batched.remote(message[1], message[2])
        except ray.exceptions.RayError as exc:
            raise WorkerLost(_first_line(exc)) from None

    async def receive(self) -> list:
        import ray

        if not self.started:  # the first receive waits for the actor to start: all start at once
            self.started = True
            await self._start()
        try:
            return await self.actor.poll.remote()
        except ray.exceptions.RayError as exc:
            if self.last:  # killed after its stop: the messages it had left come first
                last, self.last = self.last, None
                return last
            raise WorkerLost(_first_line(exc)) from None

    async def close(self) -> None:
        import ray

        try:
            self.last = await asyncio.wait_for(
                asyncio.shield(asyncio.ensure_future(self.actor.stop.remote())), STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - gone already, or stuck: it is killed below either way
            log.debug("stopping %s", self.name, exc_info=True)
        finally:
            try:
                ray.kill(self.actor)
            except Exception:  # noqa: BLE001
                pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
