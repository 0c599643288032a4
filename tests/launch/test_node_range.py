"""sbatch's ``--nodes MIN-MAX`` on the launcher's side, without Slurm: the parsing (one line with a HINT for bad
ranges), the plan's words, and what JitExecutor writes into the batch script for a range."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_jit import timing
from slurm_jit.launch import JitExecutor, node_range
from slurm_jit.launch.executor import JitExecutorError


@pytest.mark.parametrize(("value", "lowest", "highest"), [
    (2, 2, 2), ("2", 2, 2), ("1-2", 1, 2), (" 2-4 ", 2, 4), ("3-3", 3, 3),
])
def test_a_count_or_a_range_is_taken(value: object, lowest: int, highest: int) -> None:
    span = node_range.parse(value)
    assert (span.min_nodes, span.max_nodes) == (lowest, highest)
    assert span.elastic == (lowest != highest)
    assert span.sbatch_value() == (f"{lowest}-{highest}" if span.elastic else highest)


@pytest.mark.parametrize(("value", "words"), [
    (0, "--nodes 0: must be a whole number, 1 or more"),
    ("0-2", "--nodes 0-2: must be a whole number, 1 or more"),
    ("2-1", "--nodes 2-1: MIN 2 is above MAX 1. HINT: --nodes 1-2"),
    ("1.5", "not a node count or a MIN-MAX range"),
    ("1-", "not a node count or a MIN-MAX range"),
    ("-2", "not a node count or a MIN-MAX range"),
    ("1,2,4", "not a node count or a MIN-MAX range"),  # sbatch's size list: counts the plan never named
    ("1-16:4", "not a node count or a MIN-MAX range"),
    ("two", "not a node count or a MIN-MAX range"),
    (True, "not a node count"),
    (2.0, "not a node count"),
])
def test_a_bad_range_is_one_line_with_a_hint(value: object, words: str) -> None:
    with pytest.raises(ValueError) as info:
        node_range.parse(value)
    assert words in str(info.value) and "HINT" in str(info.value) and "\n" not in str(info.value)


def test_the_plan_says_a_requeue_may_come_back_on_fewer_nodes_and_what_the_trainer_does() -> None:
    assert node_range.plan_line(node_range.parse(2), 4) is None  # a fixed count: nothing to say
    line = node_range.plan_line(node_range.parse("1-2"), 4)
    assert line is not None
    assert "gets 1 to 2 nodes, so 4 or 8 ranks; a requeue may come back on fewer" in line
    assert "keeps the global batch" in line and "gradient accumulation (8 -> 4 ranks: x2)" in line
    assert "the signal lead is sized for the fewest, 4 ranks, whose optimizer step is the longest (up to 2x" in line
    uneven = node_range.plan_line(node_range.parse("2-3"), 1)
    assert uneven is not None and "(3 -> 2" not in uneven  # no integer factor to promise
    assert "on 2 ranks only where the samples per optimizer step divide" in uneven
    wide = node_range.plan_line(node_range.parse("1-99999999999"), 1)  # said by its ends, never listed
    assert wide is not None and "so 1 to 99999999999 ranks" in wide
    assert "on the counts between 1 and 99999999999 that do not divide 99999999999 ranks only where" in wide


@pytest.fixture
def ex(tmp_path: Path) -> JitExecutor:
    return JitExecutor(folder=tmp_path / "logs" / "%j", output_dir=tmp_path / "out", signal_lead_s=60)


def test_the_executor_takes_a_range_and_the_script_counts_this_starts_ranks(ex: JitExecutor) -> None:
    ex.update_parameters(timeout_min=10, nodes="1-2", tasks_per_node=2)
    assert (ex.nodes.min_nodes, ex.nodes.max_nodes, ex.world_size) == (1, 2, 4)
    script = ex.submission_text()
    lines = script.splitlines()
    assert "#SBATCH --nodes=1-2" in lines
    assert "SLURM_JIT_WORLD_SIZE=$((SLURM_JOB_NUM_NODES * 2))" in lines
    gate = next(line for line in lines if "slurm_jit.launch.gate" in line)
    assert '--world-size "$SLURM_JIT_WORLD_SIZE"' in gate
    assert lines.index("SLURM_JIT_WORLD_SIZE=$((SLURM_JOB_NUM_NODES * 2))") < lines.index(gate)
    finish = lines[-1]
    assert finish.startswith("exec ") and '--tasks "$SLURM_JIT_WORLD_SIZE"' in finish
    # sbatch would turn --ntasks-per-node=2 into --ntasks=1*2, and 2 tasks never get 2 nodes: the allocation asks
    # one task per node with both ranks' CPUs, srun starts 2 tasks on each node it got
    assert not [line for line in lines if line.startswith("#SBATCH --ntasks")]
    assert "#SBATCH --cpus-per-task=2" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--ntasks-per-node=2 --cpus-per-task=1 " in srun


def test_a_range_tells_after_step_its_fewest_nodes_for_the_hung_node_exclusion(tmp_path: Path) -> None:
    ex = JitExecutor(folder=tmp_path / "logs", output_dir=tmp_path / "out", signal_lead_s=60, exclude_hung_node=True)
    ex.update_parameters(timeout_min=10, nodes="2-4")
    assert " --exclude-hung-node --min-nodes 2" in ex.submission_text()
    ex.update_parameters(nodes=4)
    assert " --exclude-hung-node" in ex.submission_text() and "--min-nodes" not in ex.submission_text()


def test_a_fixed_count_keeps_its_script(ex: JitExecutor) -> None:
    ex.update_parameters(timeout_min=10, nodes="2", tasks_per_node=2)
    script = ex.submission_text()
    assert "#SBATCH --nodes=2" in script.splitlines() and "SLURM_JIT_WORLD_SIZE" not in script
    assert "--world-size 4" in script and "--tasks 4" in script
    assert "#SBATCH --ntasks-per-node=2" in script.splitlines() and "srun --ntasks" not in script


@pytest.mark.parametrize(("params", "words"), [
    ({"nodes": "2-1"}, "nodes='2-1': MIN 2 is above MAX 1"),
    ({"nodes": "1,2"}, "nodes='1,2': not a node count or a MIN-MAX range"),
    ({"nodes": 1.5}, "nodes=1.5: a whole number, 1 or more, or sbatch's range"),
    ({"nodes": "1-2", "slurm_additional_parameters": {"ntasks": 4}},
     "a fixed task count cannot hold on a node count that changes between restarts"),
])
def test_the_executor_refuses_a_bad_range_in_one_line(ex: JitExecutor, params: dict[str, object],
                                                      words: str) -> None:
    with pytest.raises(JitExecutorError) as info:
        ex.update_parameters(timeout_min=10, **params)
    assert words in str(info.value) and "HINT" in str(info.value) and "\n" not in str(info.value)


def _lead_s(out: Path, nodes: str) -> int:
    from slurm_jit.launch import submit

    args = submit._merged(submit._parser().parse_args(
        ["--output-dir", str(out), "--time", "60", "--nodes", nodes, "--", "python", "train.py"]))
    return submit.build_job(args).grace.lead_s


def test_the_signal_lead_of_a_range_is_sized_for_its_fewest_nodes(tmp_path: Path) -> None:
    """A timing log of 2 ranks (step 10 s, save 20 s): --nodes 1-2 may run on 1 rank, whose optimizer step (the
    global batch kept) is twice as long: the lead covers it."""
    for rank in range(2):
        log = timing.TimingLog(tmp_path, rank=rank, world_size=2, run_id="r")
        for step in range(1, 6):
            log.step(step, 10.0)
        log.save(5, "jit", 20.0, 1000)
        log.close()
    fixed, ranged = _lead_s(tmp_path, "2"), _lead_s(tmp_path, "1-2")
    assert ranged > fixed + 20  # step and save x2 (grace.shrunk_terms), not the 2-rank times
