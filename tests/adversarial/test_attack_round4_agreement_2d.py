"""The agreement check on a 2-D mesh (SPEC §19, round-4 attack): the torch platform created a group's
agreement companion once per group *object*, but a rank outside several groups gets torch's single
NON_GROUP_MEMBER for all of them, so only the first such group got a companion on that rank. On a
(2, 2) mesh ranks 0, 1 and ranks 2, 3 then made different sequences of new_group calls, and the first
check on the mesh timed out on ranks 0 and 1 while 2 and 3 went on (parallelize_model with ep= on
(dp_shard, cp) hung). Each mesh here has its own timeout, so its groups are new in the pooled worker."""
import pytest

from tests.harness import run_dist


def _check_on_fresh_2d_mesh(rank, world_size, timeout_s, odd_rank_value):
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.agreement import check_agreement

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"), timeout=timeout_s)
    value = odd_rank_value if rank == world_size - 1 else 1
    try:
        check_agreement(mesh, "round4_2d", {"setting": value}, once=False)
        check_agreement(mesh["cp"], "round4_2d_line", {"setting": 1}, once=False)
    except ValueError as error:
        return str(error)
    return "agreed"


def test_ranks_agree_on_a_fresh_2d_mesh():
    assert run_dist(4, _check_on_fresh_2d_mesh, 31, 1, timeout=120) == ["agreed"] * 4


@pytest.mark.parametrize("timeout_s", [32])
def test_a_disagreement_on_a_fresh_2d_mesh_names_the_setting_on_every_rank(timeout_s):
    results = run_dist(4, _check_on_fresh_2d_mesh, timeout_s, 2, timeout=120)
    assert all("disagree on setting" in text for text in results), results
