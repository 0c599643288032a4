"""The one phrase for a hang or a lost peer, read from stop records as the trainer writes them (the ``hung``
record's ``ranks``; the ``failed`` record's ``lost_peer``, the interface agreed for issue 20)."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_jit.train import stop_summary

HUNG = {"state": "hung", "step": 12, "ranks": [
    {"rank": 0, "node": "n1", "step": 12, "phase": "step", "since_s": 31.0,
     "frame": "distributed_c10d.py:2501 in all_reduce"},
    {"rank": 1, "node": "n2", "step": 11, "phase": "step", "since_s": 30.5, "frame": "train.py:12 in on_step_begin"},
    {"rank": 3, "node": "n9", "step": 12, "phase": "step", "since_s": 30.5, "frame": "train.py:12 in on_step_begin"}]}
DEADLOCK = {"state": "hung", "step": 4, "ranks": [  # every rank in a collective: the longest wait, then the lowest
    {"rank": 1, "node": "n2", "step": 4, "since_s": 40.0, "frame": "distributed_c10d.py:2501 in all_reduce"},
    {"rank": 0, "node": "n1", "step": 4, "since_s": 40.0, "frame": "distributed_c10d.py:2501 in broadcast"}]}
LOST = {"state": "failed", "step": 7, "error": "x",
        "lost_peer": {"rank": 1, "step": 7, "node": "n2", "how": "side group timed out"}}


@pytest.mark.parametrize(("record", "words", "node"), [
    (HUNG, "hang at step 11 on rank 1 (node n2), stack in the log", "n2"),  # not the one in the collective
    (DEADLOCK, "hang at step 4 on rank 0 (node n1), stack in the log", "n1"),
    ({"state": "hung", "step": 5}, "hang at step 5 on an unknown rank (node unknown), stack in the log", None),
    (LOST, "peer rank 1 lost at step 7 (node n2)", "n2"),
    ({**LOST, "lost_peer": {"rank": 1, "step": 7, "node": None, "how": "x"}}, "peer rank 1 lost at step 7", None),
    ({**LOST, "lost_peer": {"rank": 1, "step": 7, "node": "n2\nevil", "how": "x"}}, "peer rank 1 lost at step 7",
     None),  # a node name that is not one hostname is not passed on to scontrol or a log line
    ({**LOST, "lost_peer": {"rank": 1, "step": 7, "node": "n1,n2", "how": "x"}}, "peer rank 1 lost at step 7",
     None),  # nor a list
    ({"state": "failed", "step": 7, "error": "x"}, None, None),
    ({"state": "jit_stop", "step": 7, "lost_peer": LOST["lost_peer"]}, None, None),
    (None, None, None),
])
def test_hang_and_lost_peer_records_read_as_one_phrase(record: dict[str, Any] | None, words: str | None,
                                                       node: str | None) -> None:
    assert stop_summary.phrase(record) == words
    found = stop_summary.stuck(record)
    assert (found.node if found else None) == node


WAITING = {"state": "hung", "step": 9, "ranks": [  # rank 0 waits in the collective; rank 1 wrote no report
    {"rank": 0, "node": "n1", "step": 9, "phase": "step", "since_s": 301.0,
     "frame": "distributed_c10d.py:2501 in all_reduce"}], "unreported": [{"rank": 1, "node": "n2"}]}


@pytest.mark.parametrize(("record", "words", "node"), [
    (WAITING, "hang at step 9 on rank 1 (node n2), stack in the log", "n2"),  # never the rank that waits for it
    ({**WAITING, "ranks": []}, "hang at step 9 on rank 1 (node n2), stack in the log", "n2"),
    ({**WAITING, "ranks": [{**WAITING["ranks"][0], "frame": "train.py:12 in on_step_begin"}]},
     "hang at step 9 on rank 0 (node n1), stack in the log", "n1"),  # a rank stuck outside a collective is it
    ({**WAITING, "unreported": [{"rank": "1", "node": "n2"}]}, "hang at step 9 on rank 0 (node n1), stack in the "
     "log", "n1"),  # a malformed entry is not read
])
def test_a_rank_without_a_hang_report_is_the_one_the_waiting_ranks_wait_for(
        record: dict[str, Any], words: str, node: str) -> None:
    assert stop_summary.phrase(record) == words
    found = stop_summary.stuck(record)
    assert found is not None and found.node == node
