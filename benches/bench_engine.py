"""The rollout engine (crucible.model.batcher) on a pretrained model (SmolLM2-135M-Instruct from its
package, fp32 on CPU), every figure measured in this one run on the same weights:

- decode: a group of G episodes, each a distinct short prompt and N greedy tokens, stepped together by
  the continuous batcher, against the same batcher fed one sequence at a time, and against transformers'
  `generate` at batch 1 (the same GGUF loaded by transformers);
- shared prefill: G episodes over one long prompt (prefix sharing prefills it once) against one episode
  over it.

    python -m benches.bench_engine --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from crucible.model.batcher import ContinuousBatcher

SOURCE = "smollm2-135m-instruct"


@dataclass(eq=False)
class Seq:
    tokens: list[int]
    fed: int = 0
    routes: list = field(default_factory=list)


def greedy(seq: Seq, new: int):
    """A choose callback: append the argmax until `new` tokens are out."""
    stop = len(seq.tokens) + new

    def choose(logits: torch.Tensor, version: int) -> bool:
        seq.tokens.append(int(logits.argmax()))
        return len(seq.tokens) >= stop

    return choose


def run_group(
    model, prompts: list[list[int]], new: int, *, together: bool, max_context: int
) -> tuple[float, list[list[int]], int]:
    """Seconds to decode `new` tokens after each prompt (together, or one sequence after the other), on
    a batcher of its own (nothing kept from an earlier measurement), and the prefill tokens computed."""
    batcher = ContinuousBatcher(max_context=max_context, max_slots=len(prompts))
    batcher.swap(model, 0)
    warm = Seq([1, 2])
    batcher.run(warm, greedy(warm, 1))  # allocates the slots before the clock starts
    batcher.release(warm)
    seqs = [Seq(list(p)) for p in prompts]
    t0 = time.perf_counter()
    if together:
        futures = [batcher.submit(s, greedy(s, new)) for s in seqs]
        errors = [f.result() for f in futures]
    else:
        errors = [batcher.submit(s, greedy(s, new)).result() for s in seqs]
    seconds = time.perf_counter() - t0
    assert not any(errors), errors
    computed = batcher.stats.prefill_tokens - 2
    batcher.close()
    return seconds, [s.tokens[len(p) :] for s, p in zip(seqs, prompts, strict=True)], computed


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    outs = []
    t0 = time.perf_counter()
    for prompt in prompts:
        x = torch.tensor([prompt])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - t0, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8, help="episodes per group (G)")
    parser.add_argument("--prompt", type=int, default=32, help="tokens of each decode prompt")
    parser.add_argument("--new", type=int, default=64, help="greedy tokens per episode")
    parser.add_argument("--shared", type=int, default=1024, help="tokens of the shared prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from crucible.model.hf import load_pretrained
    from crucible.model.sources import package_file

    path = package_file(SOURCE)
    model = load_pretrained(path).eval().requires_grad_(False)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    vocab = model.cfg.vocab_size
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=rng).tolist() for _ in range(args.group)]
    shared = torch.randint(0, vocab, (args.shared,), generator=rng).tolist()

    context = args.shared + args.new + 8
    tokens = args.group * args.new
    times: dict[str, list[float]] = {
        "batched": [],
        "sequential": [],
        "transformers": [],
        "shared": [],
        "single": [],
    }
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.reps):  # alternating, so that drift hits every candidate
        seconds, outputs["batched"], _ = run_group(
            model, prompts, args.new, together=True, max_context=context
        )
        times["batched"].append(seconds)
        seconds, outputs["sequential"], _ = run_group(
            model, prompts, args.new, together=False, max_context=context
        )
        times["sequential"].append(seconds)
        seconds, outputs["transformers"] = run_transformers(reference, prompts, args.new)
        times["transformers"].append(seconds)
        times["single"].append(run_group(model, [shared], 1, together=True, max_context=context)[0])
        seconds, _, computed = run_group(model, [shared] * args.group, 1, together=True, max_context=context)
        times["shared"].append(seconds)

    median = {name: statistics.median(t) for name, t in times.items()}
    agree = (
        sum(
            a == b
            for x, y in zip(outputs["batched"], outputs["transformers"], strict=True)
            for a, b in zip(x, y, strict=False)
        )
        / tokens
    )
    summary = {
        "model": SOURCE,
        "group": args.group,
        "new_tokens": args.new,
        "shared_prompt": args.shared,
        "batched_tokens_per_s": tokens / median["batched"],
        "sequential_tokens_per_s": tokens / median["sequential"],
        "transformers_tokens_per_s": tokens / median["transformers"],
        "batched_over_sequential": median["sequential"] / median["batched"],
        "batched_over_transformers": median["transformers"] / median["batched"],
        "shared_prefill_over_single": median["shared"] / median["single"],
        "shared_prefill_tokens_computed": computed,
        "batched_equals_sequential": outputs["batched"] == outputs["sequential"],
        "greedy_agreement_with_transformers": agree,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for key, value in summary.items():
        print(f"{key:36s} {value:.3f}" if isinstance(value, float) else f"{key:36s} {value}")


if __name__ == "__main__":
    main()
