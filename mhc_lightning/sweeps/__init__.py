"""Optuna sweeps of `mhc fit`, tracked in MLflow: spec (sweep files), objective, pruning, tracking, runner."""
