"""Golden traces of 2 real DeepSpeed ranks (ZeRO-2 over gloo, real signals, real files) in five scenarios: a JIT
stop with synchronous periodic saves, the same with async periodic saves (one committed before the stop), a hung
rank (the watchdog's path), a lost peer (a rank SIGKILLed) and an evaluation cut by a stop. What each run did is
compared with tests/helpers/golden/traces/<scenario>.json, recorded on ef79d7a before train/ was restructured, so
that the move is shown to change no behaviour (issue #43 item 4).

Each trace holds the ranks' exit codes; per rank: every torch.distributed call that slurm_jit's own code made
(tests/helpers/trace_collectives.py: op, group, dtypes and shapes, never a module or function name), the timing
log's events (their names, with a save's kind and the agreement's mode) and the job-log lines slurm_jit printed;
once: the stop record and each checkpoint's manifest (its keys, its kind and the files it lists). Canonicalised:

- Every stop lands on a known step: the ranks SIGTERM themselves at a fixed step (``--signal-self-at-step``), a
  hang and a kill come while rank 1 is blocked before step 4, and tiny steps (~0.01-0.2 s, far below the 0.5 s
  from which stop rounds are read blocking, grace/rules.py) keep the agreement overlapped, so a stop comes one step
  after its signal. The number of stop rounds, steps and saves is then the same on every run and is kept exactly:
  consecutive equal items are written once with their count (``4x ...``), not collapsed away. Three recordings on
  ef79d7a gave identical traces.
- Numbers are ``<n>`` except a step, a rank and a checkpoint's number (``step 7``, ``rank 1``, ``checkpoint-7``):
  durations, byte counts (trainer_state.json holds timings), times and ports vary. Paths are ``<out>``/``<run>``,
  the host ``<node>``, 12-hex ids ``<id>``. The stop record's strings are kept (state, signal, the stuck frame,
  the gloo error the survivor saw), its ``time`` dropped.
- The hang: rank 1 blocks in user code and its watchdog fires; rank 0, which only waits for it in DeepSpeed's step
  collective, gets a longer bound (``TRACE_ARGS_RANK0``), so it never fires first: with equal bounds which rank's
  watchdog fires first is a race (test_hang_watchdog.py accepts either), and the record and rank 0's trace differ.

Re-record (only on a commit whose behaviour is meant to change, and say why in its message):
``SLURM_JIT_RECORD_GOLDEN=1 pytest -p no:xdist tests/train/test_golden_traces.py``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jit_helpers
import pytest
import trace_collectives

import slurm_jit
from slurm_jit import timing
from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "helpers" / "golden" / "traces"
RECORD = os.environ.get("SLURM_JIT_RECORD_GOLDEN") == "1"
PROGRAM = [str(ROOT / "tests" / "helpers" / "trace_collectives.py")]
# A tiny model with no step sleep: steps of ~0.01-0.2 s stay far below the 0.5 s from which stop rounds are read
# blocking (grace/rules.py), so every run reads them overlapped and a stop lands one step after its signal.
TINY = ["--width", "16", "--layers", "1", "--max-steps", "40", "--kill-wait", "0"]
# Periodic saves every 4 steps, the ranks' own SIGTERM at step 6: the save of step 4 has two steps (0.15 s each)
# to be written and claimed before the stop at step 7, which is no save step.
JIT_STOP = [*TINY, "--save-steps", "4", "--step-sleep", "0.15", "--signal-self-at-step", "6"]
STALL = ["--stall-at-step", "3", "--stall-rank", "1", "--stall-s", "100000"]  # rank 1 blocks before step 4
HANG_TIMEOUT_S = 5
RANK0_HANG_TIMEOUT_S = 120  # rank 0 never fires first: its collective fails once rank 1 is gone
LOST_AFTER_S = 2.0  # after step 3 is logged, rank 1 is in its stall
EXIT_WITHIN_S = 90  # from the hang or the kill until every rank exited (the watchdog's: bound + 5 s poll + 9 s)
NUMBER = re.compile(r"(?<!\w)(step |steps |rank |checkpoint-|global_step)?\d+(\.\d+)?(e-?\d+)?")  # not fp32's


def _run_to_end(out: Path, args: list[str], env: dict[str, str]) -> list[int | None]:
    return jit_helpers.run_logged(out, args, env, PROGRAM).codes


def _lost_peer(out: Path, args: list[str], env: dict[str, str]) -> list[int | None]:
    ranks = jit_helpers.start_ranks(out, args, env, PROGRAM)
    jit_helpers.wait_for_steps(ranks, out, 3)
    time.sleep(LOST_AFTER_S)
    ranks.signal(1, signal.SIGKILL)
    return ranks.wait(EXIT_WITHIN_S)


Run = Callable[[Path, list[str], dict[str, str]], list[int | None]]  # the ranks' exit codes
# name: (demo_train's arguments, more environment for the ranks, how the run goes)
SCENARIOS: dict[str, tuple[list[str], dict[str, str], Run]] = {
    "jit_stop": (JIT_STOP, {}, _run_to_end),
    "jit_stop_async_saves": ([*JIT_STOP, "--async-periodic-saves"], {}, _run_to_end),
    # rank 1's watchdog fires; rank 0, waiting for it in DeepSpeed's step collective with a longer bound, sees it go
    "hang": ([*TINY, *STALL, "--hang-timeout", str(HANG_TIMEOUT_S)],
             {trace_collectives.RANK_ARGS_ENV % 0: f"--hang-timeout {RANK0_HANG_TIMEOUT_S}"}, _run_to_end),
    "lost_peer": ([*TINY, *STALL], {}, _lost_peer),
    "evaluation_cut_by_stop": ([*TINY, "--eval-steps", "5", "--eval-samples", "16", "--eval-sleep", "0.2",
                                "--signal-self-at-step", "5"], {}, _run_to_end),
}


def runs(items: list[str]) -> list[str]:
    """Consecutive equal items once, counted: ``["a", "a", "b"]`` -> ``["2x a", "b"]``."""
    counted: list[list[Any]] = []
    for item in items:
        if counted and counted[-1][1] == item:
            counted[-1][0] += 1
        else:
            counted.append([1, item])
    return [item if n == 1 else f"{n}x {item}" for n, item in counted]


def _words(text: str, out: Path) -> str:
    text = text.replace(str(out), "<out>").replace(str(out.parent), "<run>")
    text = re.sub(rf"\b{re.escape(socket.gethostname())}\b", "<node>", text)
    text = re.sub(r"\b[0-9a-f]{12}\b", "<id>", text)
    return NUMBER.sub(lambda m: m[0] if m[1] and not m[2] else f"{m[1] or ''}<n>", text)


def _values(value: Any, out: Path, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _values(v, out, k) for k, v in sorted(value.items()) if k != "time"}
    if isinstance(value, list):
        return [_values(v, out, key) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int) and key in ("step", "rank"):
        return value
    if isinstance(value, (int, float)):
        return "<n>"
    return _words(str(value), out)


def _collectives(trace_dir: Path, rank: int) -> list[str]:
    lines = [json.loads(line) for line in (trace_dir / f"collectives-rank{rank}.jsonl").read_text().splitlines()]
    imported = lines.pop(0)["slurm_jit"]
    assert imported == str(Path(slurm_jit.__file__).parent), f"rank {rank} ran {imported}, not this checkout's"
    return runs([json.dumps(line, sort_keys=True) for line in lines])


def _events(out: Path, rank: int) -> list[str]:
    records = [r for r in timing.read_records(out) if r.get("rank") == rank]
    return runs([":".join(str(r[k]) for k in ("event", "kind", "mode") if k in r) for r in records])


def _log_lines(log: Path, out: Path) -> list[str]:
    lines = [line[line.index("slurm_jit:"):] for line in log.read_text(errors="replace").splitlines()
             if "slurm_jit:" in line]
    return runs([_words(line, out) for line in lines])


def _manifests(out: Path) -> dict[str, Any]:
    found = {}
    for ckpt in sorted(out.glob("checkpoint-*")):
        manifest = ckpt / protocol.MANIFEST_NAME
        if manifest.exists():
            data = json.loads(manifest.read_text())
            found[ckpt.name] = {"keys": sorted(data), "kind": data.get("kind"), "files": sorted(data["files"])}
        else:
            found[ckpt.name] = {"files_on_disk": sorted(p.name for p in ckpt.iterdir())}
    return found


def record(name: str, base: Path) -> dict[str, Any]:
    """Run the scenario under ``base`` and return its canonical trace."""
    args, more_env, run = SCENARIOS[name]
    out, trace_dir = base / "out", base / "traces"
    env = {**more_env, trace_collectives.TRACE_DIR_ENV: str(trace_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    codes = run(out, args, env)
    ranks = {}
    for rank in (0, 1):
        ranks[f"rank{rank}"] = {"collectives": _collectives(trace_dir, rank), "timing_events": _events(out, rank),
                                "job_log": _log_lines(base / "logs-out" / f"rank{rank}.log", out)}
    return {"args": args, "env": more_env, "exit_codes": codes, "stop_record": _values(stop_record.read(out), out),
            "manifests": _manifests(out), **ranks}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_trace_matches_the_golden_one(name: str, tmp_path: Path) -> None:
    got = json.dumps(record(name, tmp_path), indent=1) + "\n"
    path = GOLDEN / f"{name}.json"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    want = path.read_text() if path.exists() else ""
    diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(path), "this run"))
    assert not diff, f"the {name} trace changed (re-record only where behaviour is meant to change):\n{diff}"
