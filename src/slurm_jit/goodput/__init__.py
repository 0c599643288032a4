"""``tools/goodput`` (issue #36 items 1-3): one training of fixed length run to its end under one seeded fault
schedule, for each system in turn, on the local Slurm, and where every system's allocation time went.

- :mod:`.schedule`: the fault schedule (pure): the steps at which a rank is SIGKILLed and a rank hangs, the
  restart that is preempted, the time limit; the same instants relative to progress for every system.
- :mod:`.systems`: the three systems, (a) a plain Trainer with periodic saves and the usual ``B:USR1`` trap,
  (b) the same with upstream's ``enable_jit_checkpoint``, (c) the JitTrainer through ``python launch/submit.py``.
- :mod:`.probe` and :mod:`.train`: the training each system runs (demo_train's model and data) with a callback
  that writes the timeline (process start, imports, engine, load, every step) and fires the schedule's faults.
- :mod:`.chain`: one system's chain of jobs on Slurm, watched until the training ends or the budget is spent.
- :mod:`.report`, :mod:`.predict`, :mod:`.render` (pure): goodput, the cost of every fault split into work redone,
  detection and restart, the calculator's prediction (``slurm_jit.grace.goodput``), the table and the timeline.
- :mod:`.cli`: ``tools/goodput``.
"""
