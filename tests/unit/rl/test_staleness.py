from crucible.rl.staleness import admission_limit, staleness, trainer_version_at_group


def test_admission_keeps_every_admitted_group_within_the_bound():
    B, K, S = 2, 3, 1
    for v in range(4):
        limit = admission_limit(version=v, max_staleness=S, groups_per_step=B, publish_every=K)
        # the last admitted group is trained at most S versions later, the next one would not be
        assert trainer_version_at_group(group_index=limit - 1, groups_per_step=B, publish_every=K) - v == S
        assert trainer_version_at_group(group_index=limit, groups_per_step=B, publish_every=K) - v == S + 1


def test_hand_computed_limit():
    # version 0, two versions of slack, 2 steps per version, 4 groups per step: (0+2+1)*2*4
    assert admission_limit(version=0, max_staleness=2, groups_per_step=4, publish_every=2) == 24


def test_staleness_of_oldest_token():
    assert staleness(trainer_version=5, token_versions=[3, 4, 5]) == 2
    assert staleness(trainer_version=5, token_versions=[]) == 0
