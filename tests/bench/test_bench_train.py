"""bench.train's tables: a rate is better higher, a whole run's seconds lower, and each kfvision
run is set against the plain loop's best of the same round."""

from bench.train import _row


def test_rates_and_whole_run_seconds_each_take_the_plain_loops_best_of_the_round():
    # two rounds; the plain loop with 0 and 2 workers, kfvision once: (img/s, whole-run s)
    plain = {0: [(100.0, 50.0), (80.0, 40.0)], 2: [(200.0, 30.0), (100.0, 70.0)]}
    ours = {"default": [(300.0, 20.0), (300.0, 20.0)]}
    # rates: the best plain per round is 200, then 100 -> 1.5x and 3.0x; the workers whose
    # median is best (2: 150 img/s) name the baseline
    rates = _row("r18", plain, ours, 2, 0, best=max)
    assert rates == "| r18 | 150.0 (2) | 300.0 | 2.25x (1.50-3.00) |"
    # seconds: the fastest plain run per round is 30 s, then 40 s -> 1.5x and 2.0x as fast; the
    # workers whose median is lowest (0: 45 s) name the baseline
    seconds = _row("r18", plain, ours, 2, 1, best=min)
    assert seconds == "| r18 | 45.0 (0) | 20.0 | 1.75x (1.50-2.00) |"


def test_a_single_round_has_no_range():
    row = _row("r50", {8: [(10.0, 9.0)]}, {"a": [(20.0, 3.0)], "b": [(5.0, 18.0)]}, 1, 1, best=min)
    assert row == "| r50 | 9.0 (8) | 3.0 | 3.00x | 18.0 | 0.50x |"
