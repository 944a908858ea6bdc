"""GPU check of Crucible's MXFP8 code, and grouped-GEMM timings (one file, a few minutes on one GPU).

    python benches/gpu_mxfp8_check.py [--quick]

Correctness (exit status 1 if any fails):
  - quantize_mxfp8 / fake_quantize_mxfp8 on the GPU give the CPU's bits exactly (edge cases, random
    fp32 and bf16, blocks along either dimension), and a sample agrees with the Python reference;
  - the same under torch.compile;
  - the emulated MXFP8 linear and grouped GEMMs (forward and both gradients) agree with the CPU;
  - the bf16 grouped GEMM (one kernel on CUDA) agrees with a per-expert loop;
  - the tiny model's logits and incremental decoding on the GPU agree with the CPU.
Reported, not judged: where torchao's GPU quantizer differs from ours.
Timings: bf16 grouped GEMM vs FP8 grouped GEMM (row-wise scales on Hopper; MXFP8 block scales through
torchao on Blackwell), Crucible's emulated MXFP8 grouped GEMM, and quantizer throughput.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import traceback

import torch

from crucible.model import PRESETS, build_model
from crucible.model.matmul import grouped_linear
from crucible.model.mx_gemm import mx_grouped_mm, mx_linear
from crucible.model.mxfp8 import fake_quantize_mxfp8, quantize_mxfp8
from crucible.model.mxfp8_reference import quantize_block

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)


def edge_blocks() -> torch.Tensor:
    """[blocks, 32] fp32: maxima at and around 448 * 2^k, ties, signed zeros, NaN/Inf, subnormals, random."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(-140, 120):
        at = torch.tensor(448.0 * 2.0**k)
        for amax in (at, torch.nextafter(at, torch.tensor(math.inf)), torch.nextafter(at, torch.tensor(0.0))):
            if torch.isfinite(amax) and amax > 0:
                rows.append(torch.cat([amax.view(1), (torch.rand(31, generator=g) * 2 - 1) * amax]))
    ties = [(n + 0.5) * 2.0**-9 for n in range(8)] + [
        (8 + m + 0.5) * 2.0 ** (e - 3) for e in range(-6, 8) for m in range(8)
    ]
    ties_t = torch.tensor(ties)
    for k in (-20, 0, 30):
        for start in range(0, len(ties_t), 31):
            chunk = ties_t[start : start + 31] * 2.0**k
            rows.append(torch.cat([torch.tensor([448.0 * 2.0**k]), chunk, torch.zeros(31 - len(chunk))]))
    zero = torch.zeros(32)
    zero[::2] = -0.0
    rows.append(zero)
    for poison in (math.nan, math.inf, -math.inf):
        r = torch.randn(32, generator=g)
        r[5] = poison
        rows.append(r)
    rows.append((torch.rand(32, generator=g) * 2 - 1) * 2.0**-126)
    rows.append((torch.rand(32, generator=g) * 2 - 1) * 2.0**-118)
    rand = torch.randn(4096, 32, generator=g) * torch.exp2(
        torch.randint(-100, 100, (4096, 1), generator=g).float()
    )
    return torch.cat([torch.stack(rows), rand])


def same_bits(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(
        torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def check_quantizer(dev: str) -> None:
    x = edge_blocks()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for dim in (-1, 0):
            t = xd if dim == -1 else xd[: (xd.shape[0] // 32) * 32]
            check(
                f"quantize {dtype} dim={dim} GPU == CPU",
                same_bits(quantize_mxfp8(t.to(dev), dim=dim), quantize_mxfp8(t, dim=dim)),
            )
            check(
                f"fake_quantize {dtype} dim={dim} GPU == CPU",
                same_values(fake_quantize_mxfp8(t.to(dev), dim=dim), fake_quantize_mxfp8(t, dim=dim)),
            )
    data, scales = quantize_mxfp8(x.to(dev))
    d, s = data.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()
    picks = list(range(900)) + random.Random(0).sample(range(900, x.shape[0]), 100)
    picks = [i for i in picks if i < x.shape[0]]
    bad = [i for i in picks if quantize_block(x[i].tolist()) != (d[i].tolist(), int(s[i, 0]))]
    check("GPU quantize == Python reference", not bad, f"{len(picks)} blocks, first mismatches {bad[:5]}")
    try:
        compiled = torch.compile(quantize_mxfp8)
        ok = all(
            same_bits(compiled(x.to(dt).to(dev)), quantize_mxfp8(x.to(dt)))
            for dt in (torch.float32, torch.bfloat16)
        )
        check("torch.compile(quantize_mxfp8) GPU == CPU", ok)
    except Exception as exc:  # a compiler failure is a finding, not a crash
        check("torch.compile(quantize_mxfp8) runs", False, repr(exc)[:300])


def report_torchao(dev: str) -> None:
    try:
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    except Exception as exc:  # torchao is optional here
        print(f"[info] torchao mx_formats not importable: {exc!r}"[:300])
        return
    x = edge_blocks().to(dev)
    for label, fn in (("eager", to_mx), ("compiled", torch.compile(to_mx))):
        try:
            scales, data = fn(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
            ours_d, ours_s = quantize_mxfp8(x)
            s_diff = (
                (scales.view(torch.uint8).reshape(-1) != ours_s.view(torch.uint8).reshape(-1)).sum().item()
            )
            d_diff = (data.view(torch.uint8) != ours_d.view(torch.uint8)).any(dim=1).sum().item()
            print(
                f"[info] torchao to_mx RCEIL {label} on GPU vs ours: {s_diff} scales and {d_diff} blocks' "
                f"elements differ of {x.shape[0]} blocks"
            )
        except Exception as exc:  # reported, not judged
            print(f"[info] torchao to_mx {label} failed: {exc!r}"[:300])


def check_gemms(dev: str) -> None:
    g = torch.Generator().manual_seed(1)
    counts, K, N = [40, 0, 96, 7, 33], 256, 128
    x = torch.randn(sum(counts), K, generator=g)
    w = torch.randn(len(counts), N, K, generator=g)
    w2 = torch.randn(N, K, generator=g)
    dy = torch.randn(sum(counts), N, generator=g)

    def run(device: str, fn):
        xa, wa = x.to(device).requires_grad_(), (w if fn is not mx_linear else w2).to(device).requires_grad_()
        y = fn(xa, wa, counts) if fn is mx_grouped_mm else fn(xa, wa)
        y.backward(dy.to(device))
        return [t.detach().cpu() for t in (y, xa.grad, wa.grad)]

    for fn in (mx_linear, mx_grouped_mm):
        cpu, gpu = run("cpu", fn), run(dev, fn)
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(gpu, cpu, strict=True))
        check(f"{fn.__name__} forward/backward GPU ~ CPU", err < 1e-5, f"max relative error {err:.2e}")
    xb = x.to(dev).requires_grad_()
    wb = w.to(dev).requires_grad_()
    fast = grouped_linear(xb, wb, counts, precision="bf16")
    loop = torch.cat(
        [
            xb[a : a + c].bfloat16() @ wb[e].bfloat16().T
            for e, (a, c) in enumerate(
                zip([0, *torch.tensor(counts).cumsum(0).tolist()[:-1]], counts, strict=True)
            )
        ]
    )
    err = ((fast.float() - loop.float()).norm() / loop.float().norm()).item()
    fast.float().sum().backward()
    check(
        "bf16 grouped_mm == per-expert loop", err < 1e-2 and wb.grad is not None, f"relative error {err:.2e}"
    )


def check_model(dev: str) -> None:
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(2))
    for precision in ("fp32", "bf16", "mxfp8"):
        cpu = build_model(PRESETS["tiny"], precision=precision, seed=0).eval()
        gpu = build_model(PRESETS["tiny"], precision=precision, seed=0, device=dev).eval()
        with torch.no_grad():
            a, b = cpu(tokens), gpu(tokens.to(dev))
            err = (a.logits - b.logits.cpu()).abs().max().item()
            cache = gpu.new_cache(batch_size=2, max_len=64)
            parts = [gpu(tokens[:, :40].to(dev), cache=cache).logits]
            parts += [gpu(tokens[:, t : t + 1].to(dev), cache=cache).logits for t in range(40, 48)]
            inc = (torch.cat(parts, 1) - b.logits).abs().max().item()
        tol = 1e-3 if precision == "fp32" else 5e-2
        check(f"tiny model {precision} GPU logits ~ CPU", err < tol, f"max abs diff {err:.2e}")
        check(f"tiny model {precision} GPU incremental ~ full", inc < tol, f"max abs diff {inc:.2e}")


def cuda_time(fn, *, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def fp8_rowwise(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor):
    """A closure running a bf16 grouped GEMM's operands as FP8 E4M3 with power-of-two row-wise scales."""
    a_scale = torch.exp2(torch.floor(torch.log2(448.0 / a.float().abs().amax(dim=1).clamp(min=1e-12))))
    w_scale = torch.exp2(torch.floor(torch.log2(448.0 / w.float().abs().amax(dim=2).clamp(min=1e-12))))
    a8 = (a.float() * a_scale[:, None]).to(torch.float8_e4m3fn)
    w8_t = (w.float() * w_scale[:, :, None]).to(torch.float8_e4m3fn).transpose(-2, -1)
    inv_a, inv_w = a_scale.reciprocal(), w_scale.reciprocal()

    def run() -> torch.Tensor:
        return torch._scaled_grouped_mm(
            a8, w8_t, inv_a, inv_w, offs, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    return run


def time_shape(dev: str, *, E: int, M: int, K: int, N: int) -> None:
    cap = torch.cuda.get_device_capability()
    per = M // E
    offs = torch.arange(per, M + 1, per, device=dev, dtype=torch.int32)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16)
    w_t = w.transpose(-2, -1)
    row = {"bf16": cuda_time(lambda: torch._grouped_mm(a, w_t, offs=offs))}
    try:  # Hopper and later
        fp8 = fp8_rowwise(a, w, offs)
        ref = torch._grouped_mm(a, w_t, offs=offs).float()
        rel = ((fp8().float() - ref).norm() / ref.norm()).item()
        row["fp8-rowwise"] = cuda_time(fp8)
        print(f"[info] fp8 row-wise grouped GEMM relative error vs bf16: {rel:.3e}")
    except Exception as exc:  # a missing kernel is reported, the check goes on
        print(f"[info] fp8 row-wise grouped GEMM unavailable: {exc!r}"[:300])
    if cap >= (10, 0):
        try:
            from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

            row["mxfp8-torchao"] = cuda_time(lambda: _to_mxfp8_then_scaled_grouped_mm(a, w_t, offs=offs))
        except Exception as exc:  # as above
            print(f"[info] torchao MXFP8 grouped GEMM unavailable: {exc!r}"[:300])
    else:
        print(f"[info] sm_{cap[0]}{cap[1]}: no MX block-scaled tensor cores (sm_100+); MXFP8 is emulated")
    af, wf = a.float(), w.float()
    row["mxfp8-emulated"] = cuda_time(lambda: mx_grouped_mm(af, wf, [per] * E), reps=3)
    flops, base = 2 * M * K * N, row["bf16"]
    cells = [
        f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s, x{base / v:.2f} vs bf16)" for k, v in row.items()
    ]
    print(f"grouped GEMM E={E} M={M} K={K} N={N}: " + ", ".join(cells), flush=True)


def time_grouped_gemms(dev: str, quick: bool) -> None:
    shapes = [(8, 8192, 2048, 1408), (64, 32768, 2048, 768), (16, 16384, 4096, 2048)]
    for E, M, K, N in shapes[:1] if quick else shapes:
        time_shape(dev, E=E, M=M, K=K, N=N)


def time_quantizer(dev: str) -> None:
    x = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    gb = x.numel() * (2 + 1 + 1 / 32) / 1e9
    eager = cuda_time(lambda: quantize_mxfp8(x), reps=10)
    line = f"quantize_mxfp8 16384x4096 bf16: eager {eager:.3f} ms ({gb / eager * 1e3:.0f} GB/s)"
    try:
        compiled_fn = torch.compile(quantize_mxfp8)
        compiled = cuda_time(lambda: compiled_fn(x), reps=10)
        line += f", compiled {compiled:.3f} ms ({gb / compiled * 1e3:.0f} GB/s)"
    except Exception as exc:  # reported, not judged
        line += f", compile failed: {exc!r}"[:200]
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one GEMM shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(2)
    dev = "cuda"
    print(
        f"device: {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()} "
        f"torch {torch.__version__}"
    )
    t0 = time.time()
    for step in (check_quantizer, report_torchao, check_gemms, check_model):
        try:
            step(dev)
        except Exception:  # one failing check must not hide the others
            check(step.__name__, False, traceback.format_exc(limit=3))
    for step in (lambda d: time_grouped_gemms(d, args.quick), time_quantizer):
        try:
            step(dev)
        except Exception:  # timings are informational
            print(f"[info] timing failed: {traceback.format_exc(limit=3)}")
    print(f"done in {time.time() - t0:.0f}s; {len(FAILURES)} failures {FAILURES}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
