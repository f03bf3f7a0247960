"""The steps that use a trained model: score an image directory, evaluate the scores."""





def score_step(model, data, out_csv) -> dict:
    """Score an image directory with a trained model into a CSV; returns rows and top-1."""
    from kfvision.trainer.use.score import score

    return score(model, data, out_csv, progress=False)


def evaluate_step(scored_csv, out_dir) -> dict:
    """metrics.json, report.md and confusion_matrix.png of a scored CSV; returns the metrics."""
    from kfvision.trainer.use.evaluate import evaluate

    return evaluate(scored_csv, out_dir)
