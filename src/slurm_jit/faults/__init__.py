"""Fault injection: real faults (SIGKILL mid-save, a full disk, read-only output, corruption, signal storms,
races, hostile pickles) against real DeepSpeed ranks and the real ckpt-check; ``tools/faults`` runs them."""
