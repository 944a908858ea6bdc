"""Worker groups: run one function on every rank of a fresh process group, locally or on Ray.

`fn(*args)` runs with `torch.distributed` already initialized (gloo on CPU, NCCL when every rank has
a GPU) and its return values come back in rank order. The same function runs under both launchers:
`run_local` forks processes on this machine; `run_ray` places one actor per device with a Ray placement
group (one bundle per device) and starts a local Ray cluster when none is connected.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"
_PRELOAD = ["torch", "torch.distributed.fsdp", "crucible.parallel.train"]


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _default_backend(use_gpu: bool) -> str:
    return "nccl" if use_gpu else "gloo"


def init_worker(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
    threads: int | None = None,
    device_index: int | None = None,
) -> None:
    """Join the process group as `rank` (environment variables set the same way torchrun does)."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank if device_index is None else device_index),
    )
    if threads:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(device_index or 0)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _local_worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    import torch.distributed as dist

    try:
        init_worker(
            rank=rank,
            world_size=world_size,
            master_addr=LOOPBACK,
            master_port=port,
            backend=backend,
            timeout_s=timeout_s,
            threads=threads,
            device_index=rank if backend == "nccl" else None,
        )
    except Exception:  # noqa: BLE001 - any failure is sent to the parent with its traceback
        results.put((rank, False, (time.time(), traceback.format_exc())))
        return
    try:
        results.put((rank, True, fn(*args)))
    except Exception:  # noqa: BLE001
        # Stamped before the group is torn down, which makes the peers fail a moment later.
        results.put((rank, False, (time.time(), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def _first_failure(
    results: Any, first: tuple[int, tuple[float, str]], *, grace_s: float = 2.0
) -> RuntimeError:
    """The earliest failure: once one rank fails its peers fail too (lost connections), maybe sooner."""
    failures = dict([first])
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            failures[rank] = value
    rank = min(failures, key=lambda r: failures[r][0])
    others = sorted(set(failures) - {rank})
    also = f" (then ranks {others} failed too)" if others else ""
    return RuntimeError(f"rank {rank} failed{also}:\n{failures[rank][1]}")


def _stop(processes: Sequence[Any]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


def run_local(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    backend: str | None = None,
    timeout_s: float = 300.0,
    threads_per_process: int | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` local processes; returns the results by rank.

    Processes fork from a server that has already imported torch, so each start costs milliseconds, not
    seconds. `fn` must be importable by module and name (not a lambda or a local function). If any rank
    fails, the others are stopped and the failing rank's traceback is raised; so is a run past `timeout_s`.
    """
    import torch

    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    backend = backend or _default_backend(use_gpu)
    threads = threads_per_process or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    processes = [
        ctx.Process(
            target=_local_worker,
            args=(rank, world_size, port, backend, timeout_s, threads, fn, args, results),
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    i for i, p in enumerate(processes) if p.exitcode not in (None, 0) and i not in outputs
                ]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} exited with code {processes[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run_local: {world_size} ranks did not finish in {timeout_s:.0f}s"
                    ) from None
                continue
            if not ok:
                raise _first_failure(results, (rank, value))
            outputs[rank] = value
        for p in processes:
            p.join(timeout=30)
    finally:
        _stop(processes)
    return [outputs[rank] for rank in range(world_size)]


class _RayWorker:
    """One rank of a Ray worker group; lives in its placement-group bundle until the run ends."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def address(self) -> tuple[str, int]:
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def run(
        self, fn: Callable[..., Any], args: tuple, master: tuple[str, int], backend: str, timeout_s: float
    ) -> Any:
        import torch.distributed as dist

        init_worker(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master[0],
            master_port=master[1],
            backend=backend,
            timeout_s=timeout_s,
            threads=1,
        )
        try:
            return fn(*args)
        finally:
            dist.destroy_process_group()


def start_local_ray(*, num_cpus: int, num_gpus: int = 0, object_store_mb: int = 100) -> None:
    """A private single-node Ray cluster on the loopback interface: no dashboard, no usage reports.

    Workers get the driver's import path, so functions importable here are importable there.
    """
    import ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address=LOOPBACK,
        object_store_memory=object_store_mb * 1024 * 1024,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "RAY_USAGE_STATS_ENABLED": "0",
            }
        },
    )


def run_ray(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    use_gpu: bool | None = None,
    timeout_s: float = 600.0,
) -> list[Any]:
    """Run `fn(*args)` on a Ray worker group of `world_size` actors; returns the results by rank.

    Uses the connected Ray cluster, or starts a local one (and shuts it down afterwards). The placement
    group has one bundle per rank: one GPU each when `use_gpu` (default: when the cluster has enough
    GPUs), with NCCL; one CPU each otherwise, with gloo.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    started = not ray.is_initialized()
    if started:
        import torch

        gpus = torch.cuda.device_count() if use_gpu is not False else 0
        start_local_ray(num_cpus=max(world_size, os.cpu_count() or 1), num_gpus=gpus)
    actors: list[Any] = []
    group = None
    try:
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= world_size
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ray.get(group.ready(), timeout=timeout_s)
        worker_cls = ray.remote(_RayWorker)
        actors = [
            worker_cls.options(
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            ).remote(rank=rank, world_size=world_size)
            for rank in range(world_size)
        ]
        master = ray.get(actors[0].address.remote(), timeout=timeout_s)
        backend = _default_backend(use_gpu)
        runs = [actor.run.remote(fn, args, master, backend, timeout_s) for actor in actors]
        return ray.get(runs, timeout=timeout_s)
    finally:
        for actor in actors:
            ray.kill(actor)
        if group is not None:
            remove_placement_group(group)
        if started:
            ray.shutdown()
