"""The grace-period calculator (pure), the sbatch script checks and the grace-calc CLI."""
