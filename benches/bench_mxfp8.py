"""Cost of emulated MXFP8 against bf16 on CPU, both measured in the same run.

    python benches/bench_mxfp8.py [--preset tiny] [--steps 30] [--batch 8] [--seq 128]

1. a training step of the model (forward, backward, AdamW) at precision "mxfp8" vs "bf16";
2. one linear layer's three GEMMs (forward + backward) and the experts' grouped GEMM, mxfp8 vs bf16.
The emulation quantizes exactly and multiplies in fp32, so on CPU it measures correctness overhead,
not the speed-up MX tensor cores give; benches/gpu_mxfp8_check.py times the real kernels on a GPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import alternate

from crucible.model import PRESETS, build_model
from crucible.model.matmul import grouped_linear, linear


def model_step(preset: str, precision: str, tokens: torch.Tensor) -> Callable[[], None]:
    model = build_model(PRESETS[preset], precision=precision, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def gemm_fwd_bwd(precision: str, *, m: int, k: int, n: int, experts: int) -> tuple[Callable, Callable]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g, requires_grad=True)
    w = torch.randn(n, k, generator=g, requires_grad=True)
    w_e = torch.randn(experts, n, k, generator=g, requires_grad=True)
    counts = [m // experts] * experts
    counts[-1] += m - sum(counts)

    def dense() -> None:
        linear(x, w, precision=precision).float().sum().backward()

    def grouped() -> None:
        grouped_linear(x, w_e, counts, precision=precision).float().sum().backward()

    return dense, grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--gemm", type=int, nargs=3, default=[2048, 512, 512], metavar=("M", "K", "N"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokens = torch.randint(0, 320, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    step = alternate({p: model_step(args.preset, p, tokens) for p in ("bf16", "mxfp8")}, reps=args.steps)
    m, k, n = args.gemm
    fns = {}
    for p in ("bf16", "mxfp8"):
        fns[f"linear-{p}"], fns[f"grouped-{p}"] = gemm_fwd_bwd(p, m=m, k=k, n=n, experts=8)
    gemm = alternate(fns, reps=10)

    print(f"preset={args.preset} batch={args.batch} seq={args.seq} threads={args.threads}")
    print(
        f"train step   bf16 {step['bf16'] * 1e3:8.1f} ms   mxfp8 {step['mxfp8'] * 1e3:8.1f} ms   "
        f"ratio mxfp8/bf16 {step['mxfp8'] / step['bf16']:.2f}"
    )
    for kind in ("linear", "grouped"):
        b, x = gemm[f"{kind}-bf16"], gemm[f"{kind}-mxfp8"]
        print(
            f"{kind:8s} {m}x{k}x{n} fwd+bwd   bf16 {b * 1e3:8.1f} ms   mxfp8 {x * 1e3:8.1f} ms   "
            f"ratio mxfp8/bf16 {x / b:.2f}"
        )


if __name__ == "__main__":
    main()
