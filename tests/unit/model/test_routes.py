import pytest
import torch

from crucible.contracts import decode, encode
from crucible.contracts.messages import Trajectory
from crucible.model import build_model
from crucible.model.routes import pack_routes, pad_routes, unpack_routes


def test_recorded_decode_routes_replay_the_full_sequence_through_a_trajectory(cfg, tokens):
    """A rollout decodes token by token, records routes, ships them; training replays them exactly."""
    model = build_model(cfg, precision="bf16").eval()
    seq = tokens[:1]
    cache = model.new_cache(batch_size=1, max_len=32)
    with torch.no_grad():
        steps = [model(seq[:, :8], cache=cache).routes] + [
            model(seq[:, t : t + 1], cache=cache).routes for t in range(8, 23)
        ]
    recorded = pad_routes(torch.cat(steps, dim=1)[0], 24)  # the last token was sampled, never fed back
    data, shape = pack_routes(recorded)
    traj = Trajectory(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        task_id="k",
        taskset="s",
        tokens=b"",
        logprobs=b"",
        versions=b"",
        loss_mask=b"",
        constraints=b"",
        routes=data,
        routes_shape=shape,
    )
    back = decode(encode(traj), Trajectory)
    routes = unpack_routes(back.routes, back.routes_shape)
    assert torch.equal(routes, recorded) and (routes[-1] == -1).all()
    model.train()
    with torch.no_grad():
        for moe in model.moe_layers:
            moe.router.weight.mul_(-1.0)
    assert not torch.equal(model(seq).routes[0, :23], recorded[:23])
    out = model(seq, routes=routes[None])
    assert torch.equal(out.routes[0, :23], recorded[:23])


def test_bad_routes_bytes_are_refused():
    with pytest.raises(ValueError, match="do not hold"):
        unpack_routes(b"\x00\x01", [1, 1, 3])
    with pytest.raises(ValueError, match="255"):
        pack_routes(torch.full((1, 1, 2), 300))
    with pytest.raises(ValueError, match="more than"):
        pad_routes(torch.zeros(3, 1, 2, dtype=torch.long), 2)
