"""bench.serve's verdicts: the table's goal column applies bench.serve's bar (GOAL_ONE, GOAL_MANY,
GOAL_INT8, a p99 no worse than the plain server's) to each cell."""

from bench.serve import goal_met, overload_table, table


def _run(images_per_s: float, p99_ms: float) -> dict:
    return {"images_per_s": images_per_s, "p50_ms": p99_ms / 2, "p99_ms": p99_ms,
            "images_per_cpu_s": images_per_s / 2}


def test_the_bar_is_one_at_one_client_one_and_a_half_above_and_p99_no_worse():
    assert goal_met("kfvision", 1, 1.0, 1.0) and not goal_met("kfvision", 1, 0.99, 1.2)
    assert goal_met("kfvision", 4, 1.5, 1.0) and not goal_met("kfvision", 4, 1.49, 3.0)
    assert not goal_met("kfvision", 16, 2.0, 0.95)  # faster, but a worse p99
    assert goal_met("kfvision-int8", 16, 2.5, 1.0) and not goal_met("kfvision-int8", 16, 2.4, 2)
    assert goal_met("kfvision-int8", 4, 1.5, 1.0)


def test_the_table_has_every_cell_with_medians_of_the_rounds_ratios():
    results = {"imagenet": {
        "plain": {1: [_run(10, 100)] * 3, 16: [_run(20, 800), _run(20, 800), _run(40, 800)]},
        "kfvision": {1: [_run(20, 50)] * 3, 16: [_run(30, 400), _run(28, 400), _run(80, 900)]}}}
    text = table(results, ["kfvision", "plain"], ["imagenet"], [1, 16])
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("| imagenet", "1", "kfvision"), ("| imagenet", "1", "plain"),
        ("| imagenet", "16", "kfvision"), ("| imagenet", "16", "plain")]
    assert rows[0][4].startswith("2.00") and rows[0][-1] == "met |"
    # ratios 1.5, 1.4, 2.0 per round: median 1.50 meets the bar; p99 ratios 2, 2, 0.89
    assert rows[2][4] == "1.50 (1.40-2.00)" and rows[2][-1] == "met |"
    results["imagenet"]["kfvision"][16][0] = _run(29, 400)  # ratios 1.45, 1.4, 2.0
    rows = [line.split(" | ") for line in table(results, ["kfvision", "plain"], ["imagenet"],
                                                 [16]).splitlines()[2:]]
    assert rows[0][4].startswith("1.45") and rows[0][-1] == "**not met** |"


def test_the_overload_table_holds_each_server_to_itself_at_16_clients():
    def run(images_per_s, p99_ms, errors=0, refused=0):
        return {**_run(images_per_s, p99_ms), "errors": errors, "refused": refused}
    results = {"imagenet": {"kfvision": {16: [run(50, 500)], 64: [run(51, 1400, refused=40)],
                                         256: [run(49, 900, refused=300)]},
                            "plain": {16: [run(30, 900)], 64: [run(30, 3000)],
                                      256: [run(31, 2000, errors=2)]}}}
    rows = [line.split(" | ") for line in overload_table(
        results, ["kfvision", "plain"], ["imagenet"], [16, 64, 256]).splitlines()[2:]]
    assert [(r[1], r[2], r[-1]) for r in rows] == [
        ("64", "kfvision", "met |"), ("64", "plain", "**not met** |"),  # p99 3.33x
        ("256", "kfvision", "**not met** |"),  # 0.98x the images/s at 16
        ("256", "plain", "**not met** |")]  # errors
    assert rows[0][7] == "40" and rows[2][7] == "300"
    assert overload_table(results, ["kfvision"], ["imagenet"], [1, 4]) == ""
