"""Horovod's semantics (v0.28.1, horovod/torch/optimizer.py, functions.py, mpi_ops.py) checked on
kfvision's horovod.torch, inside one launch of every rank: each check runs on every rank, and
rank 0 prints `HVDCHECK <name> ok` when it held on all of them (the test reads those lines)."""

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

TOL = dict(rtol=1e-5, atol=1e-6)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(rank, step, n=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def check_world(hvd, env):
    assert hvd.is_initialized() and hvd.size() == int(env["WORLD_SIZE"])
    assert hvd.rank() == int(env["RANK"]) and hvd.local_rank() == int(env["LOCAL_RANK"])
    assert hvd.local_size() == int(env["LOCAL_WORLD_SIZE"])
    assert hvd.cross_size() == hvd.size() // hvd.local_size()
    assert hvd.cross_rank() == int(env["GROUP_RANK"])


def check_broadcast_parameters(hvd, env):
    model = _model(seed=hvd.rank())  # each rank starts different
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    flats = hvd.allgather_object(_flat(model))
    assert all(torch.equal(f, flats[0]) for f in flats)
    assert torch.equal(flats[0], _flat(_model(seed=0)))


def check_equals_ddp(hvd, env, steps=4):
    """SGD with momentum through hvd.DistributedOptimizer ends where DDP ends, on the same
    batches in the same order."""
    ours, theirs = _model(), DDP(_model())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=ours.named_parameters())
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(hvd.rank(), step)
        for o, m in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            _loss(m, x, y).backward()
            o.step()
    assert torch.allclose(_flat(ours), _flat(theirs.module), **TOL), \
        (_flat(ours) - _flat(theirs.module)).abs().max()
    assert not torch.equal(_flat(ours), _flat(_model()))  # it trained


def _averaged_sum_of_passes(hvd, model, batches):
    """What Horovod's backward_passes_per_step=len(batches) applies: each rank's local passes
    summed, then averaged over the ranks."""
    ref = copy.deepcopy(model)
    for x, y in batches:
        _loss(ref, x, y).backward()
    local = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    return torch.stack(hvd.allgather_object(local)).mean(0)


def check_backward_passes_per_step(hvd, env):
    model = _model()
    batches = [_batch(hvd.rank(), 10), _batch(hvd.rank(), 11)]
    expected = _flat(model) - 0.5 * _averaged_sum_of_passes(hvd, model, batches)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    for x, y in batches:
        _loss(model, x, y).backward()
    opt.step()
    assert torch.allclose(_flat(model), expected, **TOL)
    opt.zero_grad()
    for x, y in batches + batches[:1]:  # a third pass before step(): Horovod refuses it
        try:
            _loss(model, x, y).backward()
        except AssertionError as e:
            assert "more than backward_passes_per_step" in str(e)
            break
    else:
        raise AssertionError("a third backward pass was accepted")


def check_predivide_and_fp16(hvd, env):
    model = _model()
    x, y = _batch(hvd.rank(), 20)
    expected = _flat(model) - 0.5 * _averaged_sum_of_passes(hvd, model, [(x, y)])
    for kwargs, tol in (({"gradient_predivide_factor": 4.0}, TOL),
                        ({"compression": hvd.Compression.fp16}, dict(rtol=1e-2, atol=1e-3))):
        m = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.5),
                                       named_parameters=m.named_parameters(), **kwargs)
        _loss(m, x, y).backward()
        opt.step()
        assert torch.allclose(_flat(m), expected, **tol), kwargs
        assert all(p.grad.dtype == torch.float32 for p in m.parameters())


def check_missing_grad_is_zeros(hvd, env):
    """A parameter only rank 1 uses: every rank's step() reduces it, rank 0's as zeros."""
    model = _model()
    extra = torch.nn.Linear(6, 3)
    torch.nn.init.constant_(extra.weight, 0.1)
    params = list(model.named_parameters()) + [("extra." + n, p)
                                               for n, p in extra.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0),
                                   named_parameters=params)
    x, y = _batch(hvd.rank(), 30)
    out = model(x) + (extra(x) if hvd.rank() == 1 else 0)
    torch.nn.functional.cross_entropy(out, y).backward()
    local = extra.weight.grad.clone() if extra.weight.grad is not None else \
        torch.zeros_like(extra.weight)
    before = extra.weight.detach().clone()
    opt.step()
    grads = hvd.allgather_object(local)
    assert torch.allclose(extra.weight, before - torch.stack(grads).mean(0), **TOL)


def check_broadcast_optimizer_state(hvd, env):
    """A fresh Adam on every rank, with a different lr on each: afterwards rank 0's lr
    everywhere, state made by one zero-gradient step (step 1, zero moments), weights
    unchanged, and no reduction done (the ranks' weights may differ)."""
    model = _model(seed=hvd.rank())
    before = _flat(model)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(),
                                                    lr=0.01 * (hvd.rank() + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    for p in model.parameters():
        state = opt.state[p]
        assert float(state["step"]) == 1.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert torch.equal(_flat(model), before)
    plain = torch.optim.Adam(_model().parameters(), lr=0.5 + hvd.rank())
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    assert plain.param_groups[0]["lr"] == 0.5
    assert all(float(s["step"]) == 1.0 for s in plain.state.values())


def check_collectives(hvd, env):
    r, n = hvd.rank(), hvd.size()
    t = torch.tensor([1.0 + r, 2.0 * (r + 1)])
    ranks = torch.arange(n, dtype=torch.float32)
    mean = torch.tensor([1 + ranks.mean(), 2 * (ranks + 1).mean()])
    assert torch.allclose(hvd.allreduce(t), mean)
    assert torch.allclose(hvd.allreduce(t, op=hvd.Sum), torch.tensor([n + ranks.sum(),
                                                                      2 * (ranks + 1).sum()]))
    assert torch.allclose(hvd.allreduce(t, op=hvd.Min), torch.tensor([1.0, 2.0]))
    assert torch.allclose(hvd.allreduce(t, op=hvd.Max), torch.tensor([float(n), 2.0 * n]))
    assert torch.allclose(hvd.allreduce(t, op=hvd.Product),
                          torch.tensor([torch.prod(1 + ranks), torch.prod(2 * (ranks + 1))]))
    scaled = hvd.allreduce(t, op=hvd.Average, prescale_factor=2.0, postscale_factor=3.0)
    assert torch.allclose(scaled, 6.0 * hvd.allreduce(t))
    inplace = t.clone()
    handle = hvd.allreduce_async_(inplace, op=hvd.Sum)
    assert hvd.synchronize(handle) is inplace and torch.allclose(inplace,
                                                               hvd.allreduce(t, op=hvd.Sum))
    assert torch.equal(t, torch.tensor([1.0 + r, 2.0 * (r + 1)]))  # not in place: unchanged
    gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))
    assert gathered.shape == (n * (n + 1) // 2, 2)
    assert gathered[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    assert torch.equal(hvd.broadcast(torch.tensor([r]), root_rank=1), torch.tensor([1]))
    sent = torch.arange(n, dtype=torch.float32) + 10 * r  # element j goes to rank j
    got = hvd.alltoall(sent)
    assert got.tolist() == [10.0 * k + r for k in range(n)]
    out, splits = hvd.alltoall(torch.ones(n * 2) * r, splits=torch.tensor([2] * n))
    assert splits.tolist() == [2] * n and out.tolist() == [float(k) for k in range(n)
                                                            for _ in range(2)]
    assert hvd.broadcast_object({"from": r}, root_rank=0) == {"from": 0}
    assert hvd.allgather_object(r) == list(range(n))
    grad_in = torch.ones(2, requires_grad=True)
    hvd.allreduce(grad_in * (r + 1), op=hvd.Sum).sum().backward()
    assert torch.allclose(grad_in.grad, torch.full((2,), float(n * (r + 1))))  # Sum's grad: Sum
    hvd.barrier()
    assert 0 <= hvd.join() < n


def check_not_provided_is_named(hvd, env):
    for what in ("SyncBatchNorm", "elastic"):
        try:
            getattr(hvd, what)
        except hvd.HorovodNotProvidedError as e:
            assert "DistributedOptimizer" in str(e) and "requirements.txt" in str(e)
        else:
            raise AssertionError(f"hvd.{what} did not raise")
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), op=hvd.Adasum)
    except hvd.HorovodNotProvidedError as e:
        assert "Adasum" in str(e)
    else:
        raise AssertionError("Adasum did not raise")


def run_all(hvd, env):
    failed = []
    for name, check in [(k, v) for k, v in globals().items() if k.startswith("check_")]:
        try:
            check(hvd, env)
            ok = True
        except Exception as e:  # noqa: BLE001 - reported per rank, then the job fails
            print(f"HVDFAIL {name} rank {hvd.rank()}: {type(e).__name__}: {e}", flush=True)
            ok = False
        oks = hvd.allgather_object(ok)
        if all(oks):
            if hvd.rank() == 0:
                print(f"HVDCHECK {name[len('check_'):]} ok", flush=True)
        else:
            failed.append(name)
    if failed:
        raise SystemExit(f"Horovod checks failed: {', '.join(failed)}")
    dist.barrier()
