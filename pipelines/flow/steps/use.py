"""The steps that use a trained model: score an image directory, evaluate the scores."""


def score_step(model, data, out_csv, *, store_uri: str = "") -> dict:
    """Score an image directory with a trained model into a CSV; returns rows and top-1.
    `store_uri`: the image directory is that prefix of object storage (a pipeline compiled
    with --data-uri), fetched for the scoring instead of read at `data`."""
    from kfvision.pipelines.flow.steps.store import images_at
    from kfvision.trainer.use.score import score

    with images_at(data, store_uri) as here:
        return score(model, here, out_csv, progress=False)


def evaluate_step(scored_csv, out_dir) -> dict:
    """metrics.json, report.md and confusion_matrix.png of a scored CSV; returns the metrics."""
    from kfvision.trainer.use.evaluate import evaluate

    return evaluate(scored_csv, out_dir)
