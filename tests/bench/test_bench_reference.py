"""bench.reference's sums: the reference's EMA decay that equals kfvision's per-step one, and the
table's means, gaps and ratios taken per seed (no run: the runs are minutes each)."""

from bench.reference import reference_ema_decay, report


def test_the_reference_ema_decay_gives_the_same_decay_a_step():
    for decay, batch, epochs in ((0.98, 32, 6), (0.9998, 16, 2), (0.99, 128, 90)):
        given = reference_ema_decay(decay, batch, epochs)
        # references/classification/train.py: alpha = min(1, (1 - given) * batch * steps / epochs)
        alpha = min(1.0, (1.0 - given) * batch * 1 / epochs)
        assert abs((1.0 - alpha) - decay) < 1e-12


def _run(seed, model, ema, rate, first):
    return {"seed": seed, "top1_model": model, "top1_ema": ema, "top1": max(model, ema),
            "images_per_sec": rate, "seconds": 60.0, "first": first, "load": [3.0, 5.0]}


def test_the_table_takes_means_over_seeds_and_ratios_per_seed():
    saved = {"settings": {"data": "digits", "image_size": 32, "batch_size": 32, "epochs": 6,
                          "lr": 0.1, "weight_decay": 1e-4, "ema_decay": 0.98, "workers": 2,
                          "rev": "e2aff7e9"},
             "runs": {"resnet18": {
                 "reference": [_run(1, 0.80, 0.70, 10.0, True), _run(2, 0.90, 0.80, 20.0, False)],
                 "kfvision": [_run(1, 0.84, 0.76, 30.0, False), _run(2, 0.88, 0.80, 20.0, True),
                              _run(3, 0.10, 0.10, 1.0, False)]}}}  # seed 3: no pair, left out
    text = report(saved)
    row = next(line for line in text.splitlines() if line.startswith("| resnet18"))
    assert "| 2 |" in row  # two paired seeds
    assert "85.0% / 75.0%" in row and "86.0% / 78.0% (86.0%)" in row
    assert "+1.0 / +3.0" in row
    assert "2.00x (1.00-3.00)" in row  # per seed 3.0 and 1.0: median 2.0
    assert "seed 2 (kfvision first)" in text


def test_seeds_run_side_by_side_merge_and_other_settings_are_refused():
    import pytest

    from bench.reference import merged

    settings = {"data": "digits", "image_size": 32, "batch_size": 32, "epochs": 6, "lr": 0.05,
                "weight_decay": 1e-4, "ema_decay": 0.98, "workers": 2, "rev": "e2aff7e9"}
    one = {"settings": settings, "runs": {"resnet18": {
        "reference": [_run(1, 0.8, 0.8, 10.0, True)], "kfvision": [_run(1, 0.8, 0.8, 20.0, 0)]}}}
    two = {"settings": settings, "runs": {"resnet18": {
        "reference": [_run(2, 0.6, 0.6, 10.0, 0)], "kfvision": [_run(2, 0.7, 0.6, 40.0, True)]}}}
    row = next(line for line in report(merged([one, two])).splitlines()
               if line.startswith("| resnet18"))
    assert "| 2 |" in row and "+5.0 / +0.0" in row and "3.00x (2.00-4.00)" in row
    with pytest.raises(SystemExit, match="other settings"):
        merged([one, {**two, "settings": {**settings, "epochs": 3}}])


def test_runs_in_the_same_position_of_their_pairs_are_compared():
    from bench.reference import same_position

    # first runs at 10 and 20 img/s (reference, kfvision), second runs at 30 and 90
    ref = [_run(1, 0.5, 0.5, 10.0, True), _run(2, 0.5, 0.5, 30.0, False)]
    ours = [_run(1, 0.5, 0.5, 90.0, False), _run(2, 0.5, 0.5, 20.0, True)]
    assert same_position(ref, ours) == f"{(2.0 * 3.0) ** 0.5:.2f}x (first 2.00x, second 3.00x)"


def test_the_settings_of_a_generated_set_name_its_size_and_split():
    import argparse

    from bench.reference import settings

    base = dict(image_size=32, batch_size=32, epochs=12, lr=0.016, weight_decay=1e-4,
                ema_decay=0.98, workers=2, rev="e2aff7e9", images=400, train_share=0.6)
    digits = settings(argparse.Namespace(data="digits", **base))
    assert "images" not in digits and digits["epochs"] == 12
    small, large = (settings(argparse.Namespace(data="jpeg", **{**base, "images": n}))
                    for n in (400, 1000))
    assert (small["images"], small["train_share"], large["images"]) == (400, 0.6, 1000)
    assert small != large  # so merged() refuses to put them in one row
