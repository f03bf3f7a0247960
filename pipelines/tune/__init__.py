"""Hyperparameter tuning: the search space (`--param`), the Katib Experiment built around a rendered
job (experiment.py) and its client on a cluster (experimentclient.py), and the same search on this
machine with Optuna (study.py)."""
