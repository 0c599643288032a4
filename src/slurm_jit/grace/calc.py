"""The grace-period calculator: how long before its end a Slurm job must be warned to checkpoint safely.

The formula (Hugging Face transformers docs, JIT checkpointing on Slurm) is the longest step that can be
running when the signal arrives, plus the checkpoint save time, plus the trainer's kill wait before the
checkpoint starts: steps of up to 2 min and a 2 min save need 120 + 120 + 3 = 243 s, ``--signal=TERM@243``.

What the JitTrainer does, exactly (its ranks agree on the stop at step boundaries, see
:mod:`slurm_jit.train.agreement`): from the first signal until ``train()`` returns takes at most
kill_wait + latency_steps x the longest step + the longest save + the teardown (save end to ``train()``
returning). latency_steps is 1 where the trainer reads each stop round at the step boundary that started it
(blocking: steps of at least :data:`BLOCKING_MIN_STEP_S`), 2 where it reads it one step later (overlapped,
short steps). The sum is the bound whatever the step times do; ``max(kill_wait, latency_steps x step)`` would
be one only for steps of equal length. The rule that picks the mode lives here (:func:`agreement_mode`) and the
trainer imports it, so the two cannot drift apart.

This module adds an evaluation that may be running, a safety margin, and the Slurm rules around the number:

* ``--signal`` may be sent up to 60 s *earlier* than asked (sbatch(1)): N is a lower bound, and the early
  signal costs up to 60 s of compute per job end.
* At the time limit every task gets SIGTERM again and SIGKILL ``KillWait`` later (slurm.conf(5), default
  30 s): the hard budget after the warning is N + KillWait, but the checkpoint is sized to fit in N.
* At preemption ``--signal`` is not sent (unless ``SlurmctldParameters=preempt_send_user_signal``): tasks
  get SIGTERM, then SIGKILL after the partition's ``GraceTime`` + KillWait.
* N is 1..65535 (sbatch(1) allows 0, which is no warning at all).
* torchrun and the ``deepspeed`` launcher SIGKILL their workers 30 s after forwarding SIGTERM.
* Without ``B:`` only job steps (srun) get the signal, not the batch shell; with ``B:`` only the batch shell.

tests/test_grace_slurm.py checks the delivery rules and reads KillWait and GraceTime on the local cluster.

Environment contract: this project's launchers and sbatch scripts export ``SLURM_JIT_SIGNAL_LEAD_S`` = the N
of ``#SBATCH --signal=TERM@N``, so the trainer knows the budget it was given.

Pure: no torch, no I/O, no Slurm calls of its own (the queries are passed in), no clock (passed in).
The I/O that feeds it (timing log, write probe, checkpoint sizes) lives in :mod:`slurm_jit.grace.cli`.

This module is the calculator's one import point; its parts, each pure: :mod:`~.rules` (the numbers and where
they come from, the agreement-mode rule), :mod:`~.formula` (the terms and their sum), :mod:`~.parsing` (user
input), :mod:`~.timeline` (cluster facts, replays, notes) and :mod:`~.estimates` (measured and estimated terms,
an elastic conversion).
"""

from __future__ import annotations

from slurm_jit.grace.estimates import (  # noqa: F401
    Conversion,
    Measured,
    async_note,
    async_save_term,
    checkpoint_bytes_per_node,
    conversion_estimate,
    conversion_finding,
    conversion_note,
    estimate_save_s,
    format_bytes,
    measured_terms,
    select_world_size,
    shrunk_terms,
    staging_line,
)
from slurm_jit.grace.formula import (  # noqa: F401
    GraceInputs,
    GraceResult,
    Margin,
    Term,
    compute_grace,
)
from slurm_jit.grace.parsing import (  # noqa: F401
    parse_duration,
    parse_margin,
    parse_params,
    parse_size,
)
from slurm_jit.grace.rules import (  # noqa: F401
    AGREE_BLOCKING,
    AGREE_OVERLAPPED,
    BLOCKING_MAX_OVERHEAD,
    BLOCKING_MIN_STEP_S,
    DEFAULT_KILL_WAIT_S,
    DEFAULT_MARGIN_FLOOR_S,
    DEFAULT_MARGIN_FRACTION,
    DTYPE_BYTES,
    GRACE_FRACTION_WARN,
    LATENCY_STEPS,
    LAUNCHER_KILL_AFTER_S,
    LEAD_ENV_VAR,
    MASTER_COPY_BYTES,
    MIN_STEP_SAMPLES,
    OPTIMIZER_STATE_BYTES,
    SLURM_GRACE_TIME_DEFAULT_S,
    SLURM_KILL_WAIT_DEFAULT_S,
    SLURM_SIGNAL_EARLY_S,
    SLURM_SIGNAL_LEAD_MAX_S,
    SLURM_SIGNAL_LEAD_MIN_S,
    GraceError,
    agreement_mode,
    blocking_threshold_s,
    latency_reason,
)
from slurm_jit.grace.timeline import (  # noqa: F401
    ClusterFacts,
    Event,
    Timeline,
    cluster_notes,
    preemption_timeline,
    read_cluster_facts,
    time_limit_timeline,
)
