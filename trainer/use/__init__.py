"""Using a trained model: score, predict, evaluate, export, int8, plots and previews."""
