"""Crucible's transformer against transformers on the same pretrained weights (SmolLM2-135M-Instruct from
its package, fp32 on CPU): forward+backward tokens/s, KV-cached greedy decode tokens/s, and the peak
memory of each, every measurement in a fresh process of its own so that peaks do not mix.

    python -m benches.bench_models --json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

SOURCE = "smollm2-135m-instruct"


def _load(impl: str):
    from transformers import AutoModelForCausalLM

    from crucible.model.hf import load_pretrained
    from crucible.model.sources import package_file

    path = package_file(SOURCE)
    if impl == "crucible":
        return load_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _train_tps(model, impl: str, *, seq: int, batch: int, reps: int) -> float:
    vocab = model.cfg.vocab_size if impl == "crucible" else model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    model.train()
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        logits = model(x).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return batch * seq / sorted(times[1:])[len(times[1:]) // 2]


@torch.no_grad()
def _decode_tps(model, impl: str, *, prompt: int, new: int) -> float:
    model.eval()
    vocab = model.cfg.vocab_size if impl == "crucible" else model.config.vocab_size
    x = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
    if impl == "crucible":
        cache = model.new_cache(batch_size=1, max_len=prompt + new)
        logits = model(x, cache=cache).logits[0, -1]
        t0 = time.perf_counter()
        for _ in range(new):
            logits = model(logits.argmax().view(1, 1), cache=cache).logits[0, -1]
        return new / (time.perf_counter() - t0)
    out = model(x, use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    t0 = time.perf_counter()
    for _ in range(new):
        out = model(logits.argmax().view(1, 1), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return new / (time.perf_counter() - t0)


def measure(impl: str, what: str, args: argparse.Namespace) -> dict:
    """One measurement in this process: the figure and the process's peak resident memory."""
    torch.set_num_threads(args.threads)
    model = _load(impl)
    if what == "train":
        value = _train_tps(model, impl, seq=args.seq, batch=args.batch, reps=args.reps)
    else:
        value = _decode_tps(model, impl, prompt=args.prompt, new=args.new)
    return {"tokens_per_s": value, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child(impl: str, what: str, argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benches.bench_models", "--child", impl, what, *argv],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "WHAT"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.child:
        print(json.dumps(measure(*args.child, args)))
        return
    argv = [f"--{k}={getattr(args, k)}" for k in ("seq", "batch", "reps", "prompt", "new", "threads")]
    results = {
        f"{impl}_{what}": _child(impl, what, argv)
        for what in ("train", "decode")
        for impl in ("crucible", "transformers")
    }
    summary = {
        "model": SOURCE,
        **results,
        "train_over_transformers": results["crucible_train"]["tokens_per_s"]
        / results["transformers_train"]["tokens_per_s"],
        "decode_over_transformers": results["crucible_decode"]["tokens_per_s"]
        / results["transformers_decode"]["tokens_per_s"],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for key, row in results.items():
        print(f"{key:22s} {row['tokens_per_s']:9.1f} tokens/s  peak {row['peak_rss_mb']:7.0f} MB")
    print(
        f"ratios: train {summary['train_over_transformers']:.2f}x,"
        f" decode {summary['decode_over_transformers']:.2f}x"
    )


if __name__ == "__main__":
    main()
