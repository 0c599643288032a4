"""Launchers: ``python launch/submit.py`` and the helpers the sbatch scripts run (gate, task, after_step)."""
