"""Hyperparameter tuning: the search space (`--param`), the Katib Experiment built around a rendered
job, and the same search on this machine with Optuna."""
