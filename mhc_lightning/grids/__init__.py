"""`mhc grid`: a grid of `mhc fit` runs, as parallel child processes here or as SLURM jobs."""
