"""Scripts that stand in for a job's training command in the local-run tests (`python -c`), the
same for a PyTorchJob's replicas and a TrainJob's nodes: both get PET_NODE_RANK, which is the
replica's rank in a PyTorchJob (one node a replica) and the completion index in a TrainJob."""

# Node 0 exits 0 once another node has touched {tmp}/done, or 9 after 30 s; what follows is the
# other nodes' part.
NODE_0_WAITS = """
    import os, pathlib, sys, time
    d = pathlib.Path(r"{tmp}")
    if os.environ["PET_NODE_RANK"] == "0":
        for _ in range(600):
            if (d / "done").exists():
                sys.exit(0)
            time.sleep(0.05)
        sys.exit(9)
"""

# The other node fails with the listed exit codes, one per start, then succeeds.
FLAKY = NODE_0_WAITS + """
    runs = d / "runs"
    n = int(runs.read_text()) if runs.exists() else 0
    runs.write_text(str(n + 1))
    codes = {codes}
    if n < len(codes):
        print("failing with", codes[n])
        sys.exit(codes[n])
    (d / "done").touch()
"""
