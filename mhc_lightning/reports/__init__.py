"""Reports on MLflow runs: `mhc compare` (a table and plots of runs) and the grouped report (`mhc compare --group-by`,
`mhc report`: runs aggregated over seeds).

- runs.py: the one run loader (mlflow.search_runs, metric histories, per-layer diagnostics artifacts);
- tables.py: the one table writer (pandas: CSV and markdown);
- plots.py: every plot, including the one Amax-vs-layer plot (also drawn for a run's diagnostics during training);
- compare.py, grouped.py: the two reports; cli.py: their command lines.

Importing the package is cheap: matplotlib, pandas and mlflow are imported where they are used.
"""
