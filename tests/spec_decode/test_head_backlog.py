"""The kept hidden states of positions with no head KV yet: trimmed from the first position a
step computes again, given back as runs of consecutive positions with their rows in order, and
counted, so that the proposer can cap what it keeps."""

from __future__ import annotations

import torch

from octavo.spec_decode.head_backlog import HeadBacklog, Piece


def step_states(first_value: float, count: int) -> torch.Tensor:
    """A step's hidden states ``[count, 2]`` whose row i holds ``first_value + i``."""
    return (first_value + torch.arange(count, dtype=torch.float32)).unsqueeze(1).repeat(1, 2)


def test_pieces_come_back_as_one_run_in_position_order():
    backlog = HeadBacklog()
    backlog.add("a", Piece(step_states(0, 4), 0, 0, 4))  # a prompt's positions 0 .. 3
    for position in (4, 5, 6):  # then one position a step, each kept beside another request's
        kept = torch.cat([step_states(-1, 1), step_states(position, 1)])
        backlog.add("a", Piece(kept, 1, position, 1))
    assert backlog.num_positions == 7 and "a" in backlog
    (run,) = backlog.pop("a")
    assert (run.first, run.count) == (0, 7)
    assert torch.cat(run.hidden)[:, 0].tolist() == list(range(7))
    assert backlog.num_positions == 0 and "a" not in backlog and len(backlog) == 0


def test_trim_drops_the_positions_from_the_first_one_computed_again():
    backlog = HeadBacklog()
    backlog.add("a", Piece(step_states(0, 3), 0, 0, 3))
    backlog.add("a", Piece(step_states(3, 4), 0, 3, 4))  # position 3 and three drafts
    backlog.trim("a", 5)  # one draft accepted: the next step computes from position 5
    assert backlog.num_positions == 5
    backlog.trim("a", 5)
    assert backlog.num_positions == 5
    (run,) = backlog.pop("a")
    assert (run.first, run.count) == (0, 5)
    assert torch.cat(run.hidden)[:, 0].tolist() == [0, 1, 2, 3, 4]
    backlog.add("b", Piece(step_states(10, 2), 0, 10, 2))
    backlog.trim("b", 4)  # preempted and computed again from position 4: nothing is left
    assert "b" not in backlog and backlog.num_positions == 0


def test_a_gap_in_the_positions_splits_the_runs():
    backlog = HeadBacklog()
    backlog.add("a", Piece(step_states(0, 2), 0, 0, 2))
    backlog.add("a", Piece(step_states(8, 2), 0, 8, 2))  # 2 .. 7 came from the prefix cache
    runs = backlog.pop("a")
    assert [(r.first, r.count) for r in runs] == [(0, 2), (8, 2)]
    assert [torch.cat(r.hidden)[:, 0].tolist() for r in runs] == [[0, 1], [8, 9]]


def test_drop_newest_and_forget_keep_the_count():
    backlog = HeadBacklog()
    backlog.add("a", Piece(step_states(0, 3), 0, 0, 3))
    backlog.add("a", Piece(step_states(3, 1), 0, 3, 1))
    backlog.add("b", Piece(step_states(0, 2), 0, 0, 2))
    backlog.drop_newest("a")
    assert backlog.num_positions == 5
    backlog.forget(["b", "c"])
    assert backlog.num_positions == 3 and "b" not in backlog
    backlog.drop_newest("a")
    assert backlog.num_positions == 0 and "a" not in backlog
