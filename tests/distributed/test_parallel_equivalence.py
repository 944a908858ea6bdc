"""Expert parallelism x HSDP on 4 and 8 gloo processes against one rank.

The step the trainer takes (`PolicyRank.train`: the RL loss as each rank's share of the whole batch's,
backpropagated W times, clipping, AdamW, the routers' bias update, and the step skipped on every rank
when one rank's numbers are not finite) gives, on every layout, the losses, gradient norms, gradients
and updates one rank gives on the whole batch. The batch leaves an expert without tokens, so with 4-way
expert parallelism some ranks' experts get none, and its rows end in padding, which the routers' load
must skip on every rank. Below it, the layout itself: a plain language-model loss's gradients through
the parallelized model (Crucible's preset shape and an imported Qwen3-MoE) against the plain model's.
"""

from __future__ import annotations

import parallel_cases as cases
import policy_cases as policy
import pytest
import torch

from crucible.contracts.trajectories import arrays
from crucible.parallel.launch import run_local

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FP32_TOL = policy.fp32_tolerance(policy.run_config((1, 1, 1)))  # see fp32_tolerance: D x 2^-24
# MXFP8 parallel vs MXFP8 on one rank: the blocks of 32 values that share a scale follow the rows a rank
# holds, and the expert GEMMs block each expert group's tokens differently; the bf16 output head rounds
# its gradient per rank before the sum. Measured: ~2e-3.
MXFP8_REL_TOL = 1e-2
# Adam's first step moves each weight by lr g / (|g| + eps), about lr whatever |g|: where the rounding
# above flips a small gradient's sign, the weight moves 2 lr the other way. Measured: ~1.4e-2.
MXFP8_UPDATE_REL_TOL = 5e-2


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_local(policy.reference, world_size=1, backend="gloo")[0]


@pytest.fixture(scope="module")
def on_four() -> list[dict]:
    return run_local(policy.everything_on_four, world_size=4, backend="gloo")


@pytest.fixture(scope="module")
def policy_four(on_four: list[dict]) -> list[dict]:
    return [rank["policy"] for rank in on_four]


@pytest.fixture(scope="module")
def four(on_four: list[dict]) -> dict:
    return on_four[0]["layout"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return cases._rel_err(a, b)


def _assert_steps_match(run: dict, ref: dict, tolerance: float, *, label: object) -> None:
    """Each step's loss and gradient norm, the last step's gradients, and the update the steps made."""
    assert len(run["metrics"]) == len(ref["metrics"])
    for step, (got, want) in enumerate(zip(run["metrics"], ref["metrics"], strict=True)):
        assert "skipped" not in got, (label, step, got)
        assert _rel(got["loss"], want["loss"]) <= tolerance, (label, step, got["loss"], want["loss"])
        assert _rel(got["grad_norm"], want["grad_norm"]) <= tolerance, (label, step, got, want)
    assert _rel_l2(run["grads"], ref["grads"]) <= tolerance, label
    assert _rel_l2(run["update"], ref["update"]) <= tolerance, label
    biases = [n for n in ref["update"] if n.endswith("expert_bias")]
    moved = max(float(ref["update"][n].abs().max()) for n in biases)
    assert moved > 0, "the steps should move the routers' biases"
    assert max(float((run["update"][n] - ref["update"][n]).abs().max()) for n in biases) <= tolerance * moved


def test_the_trainers_step_on_four_ranks_is_the_step_on_one(one_rank: dict, policy_four: list[dict]) -> None:
    ref = one_rank["fp32"]
    assert all(m["grad_norm"] > 0.3 for m in ref["metrics"]), "the steps should exercise gradient clipping"
    assert ref["metrics"][0]["loss"] != ref["metrics"][1]["loss"]  # the second step starts elsewhere
    rows = policy_four[0]["fp32"]
    assert len(rows) == len(policy.SHAPES_OF_FOUR)
    for shape, row in zip(policy.SHAPES_OF_FOUR, rows, strict=True):
        _assert_steps_match(row, ref, FP32_TOL, label=shape)


def test_micro_batches_and_idle_ranks_on_four_ranks_are_the_step_on_one(
    one_rank: dict, policy_four: list[dict]
) -> None:
    _assert_steps_match(policy_four[0]["micro"], one_rank["fp32"], FP32_TOL, label="micro-batches")
    idle = policy_four[0]["idle"]
    _assert_steps_match(idle, one_rank["idle"], FP32_TOL, label="idle rank")
    assert all(m["rows_skipped"] == 2 for m in one_rank["idle"]["metrics"])
    assert all(m["rows_skipped"] == 0 for m in idle["metrics"])  # rank 0's: rows 2 and 3 are rank 1's


def test_mxfp8_steps_on_four_ranks_match_mxfp8_on_one(one_rank: dict, policy_four: list[dict]) -> None:
    got, want = policy_four[0]["mxfp8"], one_rank["mxfp8"]
    assert _rel(got["metrics"][0]["loss"], want["metrics"][0]["loss"]) <= 1e-5  # the forward: same blocks
    assert _rel(got["metrics"][0]["grad_norm"], want["metrics"][0]["grad_norm"]) <= MXFP8_REL_TOL
    assert _rel_l2(got["grads"], want["grads"]) <= MXFP8_REL_TOL
    assert _rel_l2(got["update"], want["update"]) <= MXFP8_UPDATE_REL_TOL


def test_a_lora_step_on_four_ranks_is_the_step_on_one_and_moves_only_the_adapters(
    one_rank: dict, policy_four: list[dict]
) -> None:
    """model.lora under EP x HSDP: the frozen base (experts sliced, everything sharded) keeps every bit,
    router biases included, and the adapters' losses, gradients and updates are one rank's."""
    got, want = policy_four[0]["lora"], one_rank["lora"]
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        assert "skipped" not in g, (step, g)
        assert _rel(g["loss"], w["loss"]) <= FP32_TOL and _rel(g["grad_norm"], w["grad_norm"]) <= FP32_TOL
    assert set(got["grads"]) == set(want["grads"]) and all(".lora." in n for n in want["grads"])
    assert _rel_l2(got["grads"], want["grads"]) <= FP32_TOL
    adapters = {n: u for n, u in want["update"].items() if ".lora." in n and n.endswith((".A", ".B"))}
    assert _rel_l2({n: got["update"][n] for n in adapters}, adapters) <= FP32_TOL
    assert all(float(u.abs().max()) > 0 for u in adapters.values())  # A moves from the second step on
    for run in (got, want):
        assert all(not u.any() for n, u in run["update"].items() if ".lora." not in n)


def test_a_step_one_rank_finds_non_finite_is_skipped_on_every_rank(policy_four: list[dict]) -> None:
    for rank, result in enumerate(policy_four):
        skipped = result["skipped"]
        assert skipped["answer"]["skipped"] == "loss", (rank, skipped["answer"])
        assert skipped["unchanged"] and skipped["optimizer_steps_unchanged"], rank


def test_the_batch_leaves_an_expert_idle_and_ends_rows_in_padding() -> None:
    trajectories, _ = policy.batch()
    first_layer = [int(e) for t in trajectories for e in arrays(t).routes[:, 0].flatten()]
    assert policy.UNUSED_EXPERT not in first_layer and len(set(first_layer)) == 3
    assert len({arrays(t).num_tokens for t in trajectories}) > 1


def test_the_trainers_step_on_eight_ranks_is_the_step_on_one(one_rank: dict) -> None:
    rows = run_local(policy.world_of_eight, world_size=8, backend="gloo")[0]
    for shape, row in zip(policy.SHAPES_OF_EIGHT, rows, strict=True):
        _assert_steps_match(row, one_rank["fp32"], FP32_TOL, label=shape)


def _assert_fp32_match(rows: list[dict]) -> None:
    for row in rows:
        assert row["clipped"], "the reference should exercise gradient clipping"
        for key in ("loss", "grad_norm", "grads_rel"):
            assert row[key] <= FP32_TOL, (row["shape"], key, row[key])


def test_batch_leaves_experts_idle_and_splits_uneven() -> None:
    _, routes = cases.global_batch(8)
    first = routes[:, :, 0].flatten()
    counts = torch.bincount(first, minlength=cases.CFG.num_experts)
    assert counts[list(cases.UNUSED_EXPERTS)].sum() == 0
    assert len(set(counts[:6].tolist())) > 1
    assert (routes[:, :, 1] == -1).all()


def test_batch_has_padding_that_the_router_load_skips() -> None:
    valid = cases.global_valid(8)
    assert valid.shape == (8 * cases.BATCH_PER_RANK, cases.SEQ)
    assert valid[:, 0].all() and not valid.all()  # every row has real tokens, some rows end in padding


def test_fp32_gradients_match_the_plain_model_on_four_ranks(four: dict) -> None:
    assert [row["shape"] for row in four["fp32"]] == [(2, 2, 2), (1, 4, 4), (2, 2, 4), (4, 1, 2), (1, 4, 1)]
    _assert_fp32_match(four["fp32"])


def test_an_imported_qwen3_moe_matches_single_process_on_four_ranks(four: dict) -> None:
    """A Qwen3-MoE built with transformers and imported (softmax router, per-head q/k norm, every layer
    sparse) trains under EP x HSDP exactly as in one process; its router has no selection bias to move."""
    assert [row["shape"] for row in four["qwen3_moe"]] == [(2, 2, 2), (1, 4, 4)]
    _assert_fp32_match(four["qwen3_moe"])


def test_default_expert_reduction_would_scale_expert_gradients_by_ep(four: dict) -> None:
    """FSDP's default mean over the expert-data mesh (W/ep ranks) gives ep times the true expert gradient;
    the dense gradients are unaffected. The parallelized model sets the reduction up to divide by W."""
    naive_ep2, naive_ep4 = four["naive"]
    assert naive_ep2["expert_scale"] == pytest.approx(2.0, rel=1e-5)
    assert naive_ep4["expert_scale"] == pytest.approx(4.0, rel=1e-5)
    assert naive_ep2["dense"] <= FP32_TOL and naive_ep4["dense"] <= FP32_TOL


def test_bad_shapes_fail_with_clear_errors(four: dict) -> None:
    world_mismatch, indivisible_experts = four["errors"]
    assert "process group has 4 ranks" in world_mismatch
    assert "num_experts=6 is not divisible by expert=4" in indivisible_experts
