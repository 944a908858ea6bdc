"""Expert-parallel dispatch: all-to-all overhead vs the experts' compute, measured in the same run.

On P gloo processes (P=1 is the local dispatch, no communication) every rank routes its tokens to the
top-k of E experts, uniformly at random, and times, forward + backward:
  experts   the grouped expert GEMMs on the rows this rank receives (no communication)
  a2a       the all-to-alls alone: counts exchange, tokens out and back, and their backward
  dispatch  the whole expert-parallel dispatch (sort, exchange, experts, exchange back, combine)
Prints the median over iterations (slowest rank) and the ratios a2a/experts and (dispatch-experts)/experts.

    python benches/bench_expert_parallel.py [--ranks 1 2 4] [--tokens 2048] [--dim 256] [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from crucible.model import ModelConfig, build_model
from crucible.parallel.expert import all_to_all_rows, apply_expert_parallel
from crucible.parallel.launch import run_local
from crucible.parallel.mesh import ParallelConfig, build_mesh

WIDTHS = (5, 11, 8, 12, 12, 17)


def _timed(fn, iters: int) -> float:
    samples = []
    for _ in range(iters + 1):  # the first run warms up
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    local = torch.tensor([statistics.median(samples[1:])], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return float(local)


def bench_rank(tokens: int, dim: int, hidden: int, experts: int, top_k: int, iters: int) -> dict[str, float]:
    P = dist.get_world_size()
    cfg = ModelConfig(
        vocab_size=16,
        dim=dim,
        n_layers=1,
        n_heads=1,
        n_kv_heads=1,
        num_experts=experts,
        top_k=top_k,
        expert_dim=hidden,
        max_seq_len=16,
    )
    model = build_model(cfg, precision="fp32", seed=0)
    mesh = build_mesh(ParallelConfig(shard=P, expert=P))
    apply_expert_parallel(model, mesh=mesh)
    moe = model.moe_layers[0]
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, dim, generator=g, requires_grad=True)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.full((tokens, top_k), 1.0 / top_k)

    flat = ids.flatten()
    send_counts = torch.bincount(flat, minlength=experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    per_rank = recv_counts.view(P, -1)
    send, recv = send_counts.view(P, -1).sum(1).tolist(), per_rank.sum(1).tolist()
    local_counts = per_rank.sum(0).tolist()
    x_local = torch.randn(sum(local_counts), dim, generator=g, requires_grad=True)
    x_sorted = x.detach()[flat.argsort(stable=True) // top_k].requires_grad_()

    def run_experts() -> None:
        moe.experts(x_local, local_counts).sum().backward()

    def run_a2a() -> None:
        counts = torch.empty_like(send_counts)
        dist.all_to_all_single(counts, send_counts)
        out = all_to_all_rows(x_sorted, recv=recv, send=send, group=dist.group.WORLD)
        all_to_all_rows(out * 1.0, recv=send, send=recv, group=dist.group.WORLD).sum().backward()

    def run_dispatch() -> None:
        moe.dispatch(x, ids, weights).sum().backward()

    return {
        "experts": _timed(run_experts, iters),
        "a2a": _timed(run_a2a, iters) if P > 1 else 0.0,
        "dispatch": _timed(run_dispatch, iters),
        "rows": float(sum(local_counts)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="expert hidden size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    a = parser.parse_args()
    print(
        f"tokens/rank={a.tokens} dim={a.dim} hidden={a.hidden} experts={a.experts} top_k={a.top_k},"
        " fp32, gloo"
    )
    header = ("ranks", "experts ms", "a2a ms", "dispatch ms", "a2a/experts", "overhead/experts")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, WIDTHS, strict=True)))
    for P in a.ranks:
        r = run_local(
            bench_rank,
            world_size=P,
            args=(a.tokens, a.dim, a.hidden, a.experts, a.top_k, a.iters),
            threads_per_process=1,
            backend="gloo",  # CPU tensors, also on a machine with GPUs
        )[0]
        overhead = (r["dispatch"] - r["experts"]) / r["experts"]
        print(
            f"{P:>5} {r['experts'] * 1e3:>11.1f} {r['a2a'] * 1e3:>8.1f} {r['dispatch'] * 1e3:>12.1f} "
            f"{r['a2a'] / r['experts']:>12.2f} {overhead:>17.2f}"
        )


if __name__ == "__main__":
    main()
