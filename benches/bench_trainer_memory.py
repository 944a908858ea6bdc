"""Peak resident memory of one RL step of SmolLM2-135M-Instruct: the trainer's rank against the layout it
replaced, measured in the same run.

Episodes are SmolLM2 chat episodes of about `--tokens` tokens: the system prompt with the tools, a task,
then tool calls (sampled tokens under the replayed tool-call grammar) and observations in turn, with
advantages of both signs. Each arm runs in a fresh process, so its peak RSS is its own:

- `rank`: `PolicyRank.train`, the trainer's step: micro-batches of `parallel.micro_batch_tokens`,
  blocks recomputed in backward, only the sampled positions through the output head, a chunk at a time,
  grammar masks packed at the sampled positions.
- `whole`: the previous layout: one forward over the whole batch, fp32 logits [B, T, V], the grammar's
  masks as bool [B, T, V], log-softmax over them, one backward.

The floor both arms share is the process with the model loaded plus the step's gradients and AdamW's
two moments (4 bytes each per parameter); the target is a peak within 2 GB of it. The whole-batch
layout does not fit this machine at 32 episodes, so it is measured at `--baseline-episodes`, and both
arms also run at that size with fp32 matmuls to check that they give the same loss and gradients.

    python -m benches.bench_trainer_memory --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODEL = "package:smollm2-135m-instruct"


def episodes(count: int, tokens: int, seed: int = 0):
    """`count` SmolLM2 episodes of about `tokens` tokens each, advantages alternating in sign."""
    import json as _json

    from crucible.agent.episode import CHAT_SYSTEM_PROMPT
    from crucible.agent.grammar import TOOL_CALL
    from crucible.agent.toolcalls import CLOSE, OPEN, render_prompt
    from crucible.contracts.messages import Trajectory
    from crucible.contracts.packing import pack
    from crucible.contracts.runconfig import RunConfig
    from crucible.model.spec import PolicySpec

    tokenizer = PolicySpec.resolve(RunConfig.model_validate({"model": {"source": MODEL}})).tokenizer
    assert tokenizer is not None
    g = torch.Generator().manual_seed(seed)
    words = "def return import class self value result path line test assert error raise".split()
    out, advantages = [], []
    for e in range(count):
        messages = [
            {"role": "system", "content": CHAT_SYSTEM_PROMPT},
            {"role": "user", "content": f"Fix the failing test in calc/ops_{e}.py."},
        ]
        ids = render_prompt(tokenizer, messages)
        sampled, constraints = [0] * len(ids), [0] * len(ids)
        turn = 0
        while len(ids) < tokens:
            call = {"name": "read_file", "arguments": {"path": f"calc/module_{e}_{turn}.py"}}
            action = tokenizer.encode(OPEN + _json.dumps(call) + CLOSE, add_special_tokens=False)
            action.append(tokenizer.eos_token_id)
            picks = torch.randint(len(words), (60,), generator=g).tolist()
            text = "\n".join(" ".join(words[i] for i in picks[j : j + 6]) for j in range(0, 60, 6))
            observation = tokenizer.encode(
                f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n",
                add_special_tokens=False,
            )
            ids += action + observation
            sampled += [1] * len(action) + [0] * len(observation)
            constraints += [TOOL_CALL] * len(action) + [0] * len(observation)
            turn += 1
        n = len(ids)
        out.append(Trajectory(
            run_id="bench", trajectory_id=f"t{e}", group_id=f"g{e // 2}", task_id="t", taskset="bench",
            tokens=pack("u32", ids), logprobs=pack("f32", [-1.0 * s for s in sampled]),
            versions=pack("u32", [0] * n), loss_mask=pack("u8", sampled), constraints=pack("u8", constraints),
        ))  # fmt: skip
        advantages.append(1.0 if e % 2 == 0 else -1.0)
    return out, advantages


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def arm(
    name: str, count: int, tokens: int, precision: str, grads_out: str | None, micro_batch_tokens: int | None
) -> dict:
    """One step of arm `name` in this process: its peak RSS, the shared floor, the loss (and gradients)."""
    import torch.distributed as dist

    from crucible.contracts.runconfig import RunConfig
    from crucible.model.spec import PolicySpec

    config = RunConfig.model_validate({
        "model": {"source": MODEL, "precision": precision},
        "optim": {"learning_rate": 1e-6, "max_grad_norm": 1e9},
        "parallel": {"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {},
    })  # fmt: skip
    spec = PolicySpec.resolve(config)
    trajectories, advantages = episodes(count, tokens)
    torch.manual_seed(0)
    if name == "rank":
        from services.trainer.group import slices
        from services.trainer.policy import PolicyRank

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        rank = PolicyRank(config, spec)
        model, optimizer = rank.model, rank.optimizer
        (part,) = slices(trajectories, advantages, world_size=1)
        floor = rss_bytes()
        t0 = time.perf_counter()
        loss = float(rank.train(part)["loss"])
    else:
        model = spec.initial_model(seed=config.seed).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.learning_rate, weight_decay=0.0)
        floor = rss_bytes()
        t0 = time.perf_counter()
        loss = whole_batch_step(model, optimizer, spec, config, trajectories, advantages)
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    if grads_out:
        from safetensors.torch import save_file

        from crucible.parallel import full_grads

        grads = full_grads(model)  # the rank's are sharded tensors (a mesh of one); the plain model's too
        save_file({n: g.contiguous() for n, g in grads.items()}, grads_out)
    return {
        "arm": name, "episodes": count, "tokens": sum(len(t.tokens) // 4 for t in trajectories),
        "precision": precision, "micro_batch_tokens": config.parallel.micro_batch_tokens,
        "loss": loss, "seconds": round(seconds, 1),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
        # the model loaded, plus gradients and AdamW's two moments: fp32, 4 bytes x 3 per parameter
        "floor_gb": (floor + 12 * params) / 2**30,
        "optimizer_steps": len(optimizer.state),
    }  # fmt: skip


def whole_batch_step(model, optimizer, spec, config, trajectories, advantages) -> float:
    """The previous layout's step: full logits and full grammar masks for the whole batch at once."""
    from crucible.agent.grammar import TOOL_CALL, masked_logprobs
    from crucible.model.scoring import unpack_allowed
    from crucible.rl.losses import BatchTotals, policy_loss
    from services.trainer.batch import collate

    batch = collate(trajectories, advantages)
    vocab = model.cfg.vocab_size
    masks = torch.ones(*batch.tokens_BT.shape, vocab, dtype=torch.bool)
    for b, (tokens, constraints) in enumerate(zip(batch.tokens_BT, batch.constraints_BT, strict=True)):
        constrained = constraints == TOOL_CALL
        masks[b, constrained] = unpack_allowed(
            spec.tool_calls.replay(tokens.tolist(), constrained.tolist()), vocab
        )
    logits = model(batch.tokens_BT, valid_BT=batch.valid_BT).logits[:, :-1]
    logp = masked_logprobs(logits, masks[:, 1:], temperature=config.agent.temperature)
    picked = logp.gather(-1, batch.tokens_BT[:, 1:, None]).squeeze(-1)
    picked = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1) * (batch.mask_BT > 0)
    loss = policy_loss(
        logprobs_BT=picked, behaviour_logprobs_BT=batch.behaviour_logprobs_BT,
        advantages_BT=batch.advantages_BT, mask_BT=batch.mask_BT, optim=config.optim,
        totals=BatchTotals.of(batch.mask_BT),
    ).loss  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def run_arm(
    name: str,
    count: int,
    tokens: int,
    precision: str,
    grads_out: str | None = None,
    micro_batch_tokens: int | None = None,
) -> dict:
    command = [sys.executable, "-m", "benches.bench_trainer_memory", "--arm", name]
    command += ["--episodes", str(count), "--tokens", str(tokens), "--precision", precision]
    if grads_out:
        command += ["--grads-out", grads_out]
    if micro_batch_tokens:
        command += ["--micro-batch-tokens", str(micro_batch_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"arm": name, "episodes": count, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--baseline-episodes", type=int, default=4)
    parser.add_argument(
        "--micro-batch-tokens", type=int, help="the rank's parallel.micro_batch_tokens (default: its default)"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--arm", choices=["rank", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    parser.add_argument("--grads-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(arm(
            args.arm, args.episodes, args.tokens, args.precision, args.grads_out, args.micro_batch_tokens
        )))  # fmt: skip
        return
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        # the same step both ways at the baseline's size, fp32 matmuls: loss and gradients agree
        small = args.baseline_episodes
        pair = [
            run_arm(a, small, args.tokens, "fp32", str(Path(tmp) / f"{a}.safetensors"))
            for a in ("whole", "rank")
        ]
        grads = [load_file(str(Path(tmp) / f"{a}.safetensors")) for a in ("whole", "rank")]
    worst = max(float((grads[1][n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in grads[0].items())
    # the longest reduction a value passes through: the batch's tokens or the vocabulary (49152)
    tolerance = max(small * args.tokens, 49152) * 2.0**-24
    rank = run_arm("rank", args.episodes, args.tokens, "bf16", micro_batch_tokens=args.micro_batch_tokens)
    whole = run_arm("whole", small, args.tokens, "bf16")
    result = {
        "model": MODEL,
        "rank": rank,
        "whole_batch": whole,
        "rank_working_gb": rank.get("peak_rss_gb", 0) - rank.get("floor_gb", 0),
        "whole_batch_working_gb": whole.get("peak_rss_gb", 0) - whole.get("floor_gb", 0),
        "equivalence": {
            "episodes": small, "loss": [p.get("loss") for p in pair],
            "loss_rel_diff": abs(pair[0]["loss"] - pair[1]["loss"]) / abs(pair[0]["loss"]),
            "worst_grad_rel_l2": worst, "tolerance": tolerance,
        },
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"rank, {args.episodes} x {args.tokens} tokens: peak {rank['peak_rss_gb']:.2f} GB, "
        f"floor {rank['floor_gb']:.2f} GB, working {result['rank_working_gb']:.2f} GB in {rank['seconds']} s"
    )
    print(
        f"whole batch, {small} x {args.tokens}: peak {whole['peak_rss_gb']:.2f} GB, "
        f"working {result['whole_batch_working_gb']:.2f} GB"
    )
    print(f"fp32 equivalence at {small} episodes: {result['equivalence']}")


if __name__ == "__main__":
    main()
