"""The kept hidden states of positions with no head KV yet: trimmed from the first position a
step computes again, given back as runs of consecutive positions with their rows in order, and
counted, so that the proposer can cap what it keeps."""

from __future__ import annotations

import torch

from octavo.spec_decode.head_backlog import HeadBacklog, PendingHeadKV, Piece, Run


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


def test_pending_positions_are_kept_by_block_and_given_back_in_a_readers_positions():
    """A finished request's run of positions 5 .. 14 (block size 4, its table 10, 11, 12, 13:
    the run lies in blocks 11, 12 and 13): kept block by block; a reader gets a block's
    positions where the block is in its own table, adjacent blocks' as one run."""
    pending = PendingHeadKV(block_size=4, max_positions=100)
    pending.add([10, 11, 12, 13], [Run(5, 10, [step_states(5, 6), step_states(11, 4)])])
    assert len(pending) == 3 and pending.num_positions == 10
    (run,) = pending.pop([99, 12])  # block 12 is the reader's second: positions 4 .. 7
    assert (run.first, run.count) == (4, 4)
    assert torch.cat(run.hidden)[:, 0].tolist() == [8, 9, 10, 11]
    assert pending.pop([12]) == [] and pending.num_positions == 6
    (run,) = pending.pop([11, 13])  # block 11 from offset 1, then block 13 (three positions)
    assert (run.first, run.count) == (1, 6)
    assert torch.cat(run.hidden)[:, 0].tolist() == [5, 6, 7, 12, 13, 14]
    assert len(pending) == 0 and pending.num_positions == 0


def test_pending_blocks_computed_again_are_dropped_and_the_oldest_go_past_the_cap():
    pending = PendingHeadKV(block_size=4, max_positions=8)
    pending.add([1, 2], [Run(0, 8, [step_states(0, 8)])])
    pending.drop([2, 7])
    assert pending.num_positions == 4 and pending.pop([0, 2]) == []
    pending.add([3, 4], [Run(0, 8, [step_states(100, 8)])])  # 12 positions: block 1 goes
    assert pending.num_positions == 8 and pending.pop([1]) == []
    (run,) = pending.pop([3, 4])
    assert (run.first, run.count) == (0, 8)
    assert torch.cat(run.hidden)[:, 0].tolist() == [100 + i for i in range(8)]


def test_pending_positions_are_copies():
    """The steps' tensors they came from can go (and may be reused by a graph runner)."""
    states = step_states(0, 4)
    pending = PendingHeadKV(block_size=4, max_positions=100)
    pending.add([0], [Run(0, 4, [states])])
    states.zero_()
    (run,) = pending.pop([0])
    assert torch.cat(run.hidden)[:, 0].tolist() == [0, 1, 2, 3]
