"""A rank's place in the layout, as one pure function of the layout and the layer counts."""

from __future__ import annotations

import pytest

from ringsched.layout.rank import Layout, StageInfo, node_rank_infos, rank_infos


def test_pipeline_only_is_one_rank_per_stage():
    ranks = rank_infos(Layout(pp_size=3), [10, 10, 10])
    assert [(r.rank, r.pp, r.tp, r.cp, r.node, r.local_rank) for r in ranks] == [
        (0, 0, 0, 0, 0, 0), (1, 1, 0, 0, 0, 1), (2, 2, 0, 0, 0, 2),
    ]  # fmt: skip
    assert [r.stage for r in ranks] == [StageInfo(0, 3, 0, 10), StageInfo(1, 3, 10, 20), StageInfo(2, 3, 20, 30)]
    assert all(r.pp_group == (0, 1, 2) and r.tp_group == (r.rank,) and r.cp_group == (r.rank,) for r in ranks)
    assert [r.decides for r in ranks] == [True, False, False]


def test_tensor_and_context_groups_sit_inside_a_stage_and_a_node():
    layout = Layout(pp_size=2, tp_size=2, cp_size=2, nnodes=2)
    ranks = rank_infos(layout, [16, 14])
    assert len(ranks) == layout.world_size == 8 and [r.rank for r in ranks] == list(range(8))
    r = ranks[layout.rank_of(pp=1, tp=1, cp=0)]
    assert (r.rank, r.pp, r.tp, r.cp, r.node, r.local_rank) == (5, 1, 1, 0, 1, 1)
    assert r.stage == StageInfo(1, 2, 16, 30)
    assert r.tp_group == (4, 5) and r.cp_group == (5, 7) and r.stage_group == (4, 5, 6, 7)
    assert r.pp_group == (1, 5)  # the same tp and cp index in every stage
    assert {x.node for x in ranks if x.pp == 0} == {0} and {x.node for x in ranks if x.pp == 1} == {1}
    assert [x.rank for x in node_rank_infos(layout, [16, 14], 1)] == [4, 5, 6, 7]
    assert sum(x.decides for x in ranks) == 1 and sum(x.leads_stage for x in ranks) == 2


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="split evenly"):
        Layout(pp_size=3, nnodes=2)
    with pytest.raises(ValueError, match="one node"):
        Layout(pp_size=1, tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="layer counts"):
        rank_infos(Layout(pp_size=2), [30])
