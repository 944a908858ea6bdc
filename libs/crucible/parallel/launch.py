"""Worker groups: `world_size` ranks in a fresh process group, each holding an object the caller drives.

`start_workers(factory, args=..., world_size=N)` starts N ranks with `torch.distributed` initialized
(gloo on CPU, NCCL when every rank has a GPU); each rank builds `factory(*args)` once, and
`group.call(Rank.method, *args)` then runs that method on every rank at once (`call_each` gives each
rank its own arguments) and returns the results in rank order. Methods are named by the class's own
function (`PolicyRank.train`), which a reader and a type checker follow; the rank runs its object's
method of that name, so a subclass's override is the one called. Two launchers run the same ranks:

- `local`: processes forked from a server that has already imported torch (a start costs milliseconds);
- `ray`: one actor per rank in a Ray placement group with one bundle per device, on the connected
  cluster, the one at `ray_address`, or a private local one.

A rank that raises, dies or runs past the call's deadline breaks the group: the other ranks are
stopped (their peers would wait in a collective forever) and `WorkerGroupError` names the first rank
that failed, with its traceback. A broken group takes no more calls. `run_local` and `run_ray` are the
one-shot form: one function on every rank, then the group is gone.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar

LOOPBACK = "127.0.0.1"
PRELOAD = ("torch", "torch.distributed.fsdp", "crucible.parallel.train")

Launcher = Literal["local", "ray"]
Poll = Callable[[set[int], float], dict[int, tuple[bool, Any]]]
POLL_S = 0.2
GRACE_S = 2.0  # after a rank's failure, how long its peers may take to report theirs


T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


def method_name(method: Callable[..., Any]) -> str:
    """The name a rank looks its method up by: `Rank.method` (a function defined in a class body)."""
    name = getattr(method, "__name__", None)
    if not isinstance(name, str) or "." not in getattr(method, "__qualname__", ""):
        raise TypeError(f"a worker group calls a method of its ranks' class (Rank.method), not {method!r}")
    return name


class WorkerGroupError(RuntimeError):
    """A rank failed, died or timed out; the group is stopped and takes no more calls."""


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


class WorkerGroup(Generic[T]):
    """The ranks of one group, each holding a T; use `start_workers` to make one."""

    world_size: int
    launcher: Launcher
    backend: str
    timeout_s: float
    broken: str | None

    def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """`method(*args, **kwargs)` on every rank's object; the results in rank order."""
        return self.call_each(method, [(args, kwargs)] * self.world_size)

    def call_each(
        self, method: Callable[Concatenate[T, ...], R], per_rank: Sequence[tuple[tuple, dict[str, Any]]]
    ) -> list[R]:
        """`method(*args_r, **kwargs_r)` on rank r's object, for every rank at once (`per_rank[r]` is
        `(args_r, kwargs_r)`); the results in rank order."""
        name = method_name(method)
        if self.broken:
            raise WorkerGroupError(f"the worker group is stopped: {self.broken}")
        if len(per_rank) != self.world_size:
            raise ValueError(f"{len(per_rank)} argument tuples for {self.world_size} ranks")
        return self._send(name, [(tuple(args), dict(kwargs)) for args, kwargs in per_rank])

    def _send(self, name: str, per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
        """Run the method called `name` on every rank with its arguments; the results in rank order."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _break(self, reason: str) -> None:
        """Stop every rank: the group takes no more calls."""
        raise NotImplementedError

    def _gather(self, poll: Poll, timeout_s: float, *, what: str) -> list[Any]:
        """Every rank's answer, in rank order. `poll(pending, wait_s)` returns the answers of the pending
        ranks that came within `wait_s`: (True, result), or (False, (when, why)) for a rank that failed.
        A failure breaks the group, its peers first given GRACE_S to report theirs, so that the earliest
        is the one named; so does a rank that has not answered in `timeout_s`."""
        pending = set(range(self.world_size))
        outputs: dict[int, Any] = {}
        failures: dict[int, tuple[float, str]] = {}
        deadline, grace_until = time.monotonic() + timeout_s, None
        while pending:
            left = (deadline if grace_until is None else grace_until) - time.monotonic()
            if left <= 0:
                break
            for rank, (ok, value) in poll(pending, min(left, POLL_S)).items():
                pending.discard(rank)
                (outputs if ok else failures)[rank] = value
            if failures and grace_until is None:
                grace_until = time.monotonic() + GRACE_S
        if failures:
            error = _first_failure(failures)
            self._break(str(error).splitlines()[0])
            raise error
        if pending:
            self._break(f"{what} timed out")
            raise WorkerGroupError(
                f"{what}: {len(pending)} of {self.world_size} ranks did not answer in {timeout_s:.0f} s"
            )
        return [outputs[rank] for rank in range(self.world_size)]

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(
    rank: int, world_size: int, port: int, backend: str, timeout_s: float, threads: int,
    factory: Callable[..., Any], args: tuple, conn: Any,
) -> None:  # fmt: skip
    """A local rank: build the object, then answer calls until the driver hangs up."""
    import torch.distributed as dist

    try:
        init_worker(
            rank=rank, world_size=world_size, master_addr=LOOPBACK, master_port=port, backend=backend,
            timeout_s=timeout_s, threads=threads, device_index=rank if backend == "nccl" else None,
        )  # fmt: skip
        target = factory(*args)
        conn.send((True, None))
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            method, call_args, call_kwargs = request
            conn.send((True, getattr(target, method)(*call_args, **call_kwargs)))
    except Exception:  # sent to the driver with its traceback
        # Stamped before the group is torn down, which makes the peers fail a moment later.
        try:
            conn.send((False, (time.time(), traceback.format_exc())))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_failure(failures: dict[int, tuple[float, str]]) -> WorkerGroupError:
    """The earliest failure: once one rank fails its peers fail too (lost connections), maybe sooner."""
    rank = min(failures, key=lambda r: failures[r][0])
    others = sorted(set(failures) - {rank})
    also = f" (then ranks {others} failed too)" if others else ""
    return WorkerGroupError(f"rank {rank} failed{also}:\n{failures[rank][1]}")


class LocalWorkerGroup(WorkerGroup[T]):
    launcher: Launcher = "local"

    def __init__(
        self, factory: Callable[..., Any], *, args: tuple, world_size: int, backend: str | None,
        timeout_s: float, threads_per_process: int | None, preload: Sequence[str],
    ) -> None:  # fmt: skip
        import torch

        use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        self.world_size, self.timeout_s = world_size, timeout_s
        self.backend = backend or _default_backend(use_gpu)
        self.broken: str | None = None
        threads = threads_per_process or max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, *preload])
        port = free_port()
        self.conns, self.processes = [], []
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=_serve,
                args=(rank, world_size, port, self.backend, timeout_s, threads, factory, args, theirs),
                daemon=True,
            )
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        try:
            self._collect(timeout_s, what="start")
        except BaseException:
            self.close()
            raise

    def _send(self, name: str, per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
        try:
            for conn, (args, kwargs) in zip(self.conns, per_rank, strict=True):
                conn.send((name, args, kwargs))
        except OSError as exc:
            self._break(f"a rank is gone: {exc!r}")
            raise WorkerGroupError(f"{name}: a rank is gone ({exc!r})") from exc
        return self._collect(self.timeout_s, what=name)

    def _collect(self, timeout_s: float, *, what: str) -> list[Any]:
        return self._gather(self._poll, timeout_s, what=what)

    def _poll(self, pending: set[int], wait_s: float) -> dict[int, tuple[bool, Any]]:
        by_conn = {self.conns[rank]: rank for rank in pending}
        answers = {}
        for ready in multiprocessing.connection.wait(list(by_conn), timeout=wait_s):
            rank = by_conn[ready]
            try:
                answers[rank] = self.conns[rank].recv()
            except (EOFError, OSError):
                # Died without a word (killed, or exited): taken as the cause, stamped before any peer's
                # error, which is then a lost connection to it.
                self.processes[rank].join(timeout=1)
                answers[rank] = (
                    False,
                    (0.0, f"rank {rank} exited with code {self.processes[rank].exitcode}"),
                )
        return answers

    def _break(self, reason: str) -> None:
        self.broken = reason
        self._stop()

    def _stop(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    def close(self) -> None:
        if not self.broken:
            self.broken = "closed"
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for p in self.processes:
                p.join(timeout=30)
        self._stop()
        for conn in self.conns:
            conn.close()


class _RayRank:
    """One rank of a Ray worker group; lives in its placement-group bundle until the group closes."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.target: Any = None

    def address(self) -> tuple[str, int]:
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(
        self,
        factory: Callable[..., Any],
        args: tuple,
        master: tuple[str, int],
        backend: str,
        timeout_s: float,
    ) -> None:
        init_worker(
            rank=self.rank, world_size=self.world_size, master_addr=master[0], master_port=master[1],
            backend=backend, timeout_s=timeout_s, threads=1,
        )  # fmt: skip
        self.target = factory(*args)

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        return getattr(self.target, method)(*args, **kwargs)


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
        runtime_env={"env_vars": _worker_env()},
    )


def _worker_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "RAY_USAGE_STATS_ENABLED": "0"}


def connect_ray(address: str | None, *, world_size: int) -> bool:
    """Connect to the Ray cluster at `address`, or start a private local one when it is empty; returns
    whether this call did so (False: already connected)."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": _worker_env()})
    else:
        import torch

        start_local_ray(num_cpus=max(world_size, os.cpu_count() or 1), num_gpus=torch.cuda.device_count())
    return True


class RayWorkerGroup(WorkerGroup[T]):
    launcher: Launcher = "ray"

    def __init__(
        self, factory: Callable[..., Any], *, args: tuple, world_size: int, use_gpu: bool | None,
        timeout_s: float, ray_address: str | None,
    ) -> None:  # fmt: skip
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size, self.timeout_s = world_size, timeout_s
        self.broken: str | None = None
        self.actors: list[Any] = []
        self.group = None
        self.started_ray = connect_ray(ray_address, world_size=world_size)
        try:
            if use_gpu is None:
                use_gpu = ray.cluster_resources().get("GPU", 0) >= world_size
            self.backend = _default_backend(use_gpu)
            bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
            self.group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            ray.get(self.group.ready(), timeout=timeout_s)
            rank_cls = ray.remote(_RayRank)
            self.actors = [
                rank_cls.options(
                    num_cpus=1,
                    num_gpus=1 if use_gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.group, placement_group_bundle_index=rank
                    ),
                ).remote(rank=rank, world_size=world_size)
                for rank in range(world_size)
            ]
            master = ray.get(self.actors[0].address.remote(), timeout=timeout_s)
            self._wait([a.setup.remote(factory, args, master, self.backend, timeout_s) for a in self.actors],
                       timeout_s, what="start")  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _send(self, name: str, per_rank: list[tuple[tuple, dict[str, Any]]]) -> list[Any]:
        refs = [
            actor.call.remote(name, args, kwargs)
            for actor, (args, kwargs) in zip(self.actors, per_rank, strict=True)
        ]
        return self._wait(refs, self.timeout_s, what=name)

    def _wait(self, refs: list[Any], timeout_s: float, *, what: str) -> list[Any]:
        """The results of one task per rank (`refs` in rank order)."""
        import ray
        import ray.exceptions

        rank_of = {ref: rank for rank, ref in enumerate(refs)}

        def poll(pending: set[int], wait_s: float) -> dict[int, tuple[bool, Any]]:
            ready, _ = ray.wait([refs[r] for r in pending], num_returns=len(pending), timeout=wait_s)
            answers = {}
            for ref in ready:
                rank = rank_of[ref]
                try:
                    answers[rank] = (True, ray.get(ref))
                except ray.exceptions.RayActorError as exc:  # died: the cause, as in the local launcher
                    answers[rank] = (False, (0.0, f"rank {rank} died: {exc}"))
                except Exception as exc:  # raised: its traceback is inside
                    answers[rank] = (False, (time.time(), str(exc)))
            return answers

        return self._gather(poll, timeout_s, what=what)

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.close()

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self.broken = self.broken or "closed"
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False


def start_workers(
    factory: Callable[..., T],
    *,
    world_size: int,
    args: tuple = (),
    launcher: Launcher = "local",
    backend: str | None = None,
    timeout_s: float = 300.0,
    threads_per_process: int | None = None,
    preload: Sequence[str] = (),
    ray_address: str | None = None,
    keep_ray: bool = False,
) -> WorkerGroup[T]:
    """Start `world_size` ranks that each build `factory(*args)` (importable by module and name, not a
    lambda or a local function). `timeout_s` bounds the start and every call (and the collectives).

    `ray`: the group connects to `ray_address` (or starts a private local cluster when empty) unless
    Ray is already connected; with `keep_ray` a cluster it started outlives the group (a service that
    starts groups again and again), else it is shut down with the group. `backend` applies to `local`;
    on Ray, NCCL when the cluster has a GPU per rank, else gloo.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if launcher == "local":
        return LocalWorkerGroup(
            factory, args=args, world_size=world_size, backend=backend, timeout_s=timeout_s,
            threads_per_process=threads_per_process, preload=preload,
        )  # fmt: skip
    if launcher == "ray":
        group = RayWorkerGroup(
            factory, args=args, world_size=world_size, use_gpu=None if backend is None else backend == "nccl",
            timeout_s=timeout_s, ray_address=ray_address,
        )  # fmt: skip
        if keep_ray:
            group.started_ray = False
        return group
    raise ValueError(f"unknown launcher {launcher!r}: local or ray")


class _Runner:
    """The rank of a one-shot group: runs the function it is handed."""

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        return fn(*args)


def run_local(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    backend: str | None = None,
    timeout_s: float = 300.0,
    threads_per_process: int | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` local processes; returns the results by rank. If any rank fails,
    the others are stopped and the failing rank's traceback is raised; so is a run past `timeout_s`."""
    with start_workers(
        _Runner,
        world_size=world_size,
        backend=backend,
        timeout_s=timeout_s,
        threads_per_process=threads_per_process,
    ) as group:
        return group.call(_Runner.run, fn, args)


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
    backend = None if use_gpu is None else _default_backend(use_gpu)
    with start_workers(
        _Runner, world_size=world_size, launcher="ray", backend=backend, timeout_s=timeout_s
    ) as group:
        return group.call(_Runner.run, fn, args)
