"""Horovod's DistributedOptimizer, broadcast_parameters and broadcast_optimizer_state (v0.28.1,
horovod/torch/optimizer.py and functions.py: the semantics are theirs, the code ours) on
pipelines/script/hvd.py's collectives. See that module for what differs (the reductions are
issued in step(), in one order on every rank)."""

import collections
import warnings
from contextlib import contextmanager

import torch
from kfvision.pipelines.script import hvd
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class _DistributedOptimizer(torch.optim.Optimizer):
    """Its methods are copied into a subclass of the script's optimizer class, as Horovod does
    (DistributedOptimizer), so that `isinstance(opt, torch.optim.Adam)` still holds."""

    _kfvision_hvd = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=hvd.Average, gradient_predivide_factor=1.0):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(dups)}")
        unnamed = ({id(v) for g in self.param_groups for v in g["params"]}
                   - {id(v) for _, v in named_parameters})
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             "were not named. Python object ids: "
                             f"{', '.join(str(i) for i in unnamed)}")
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for v in self._parameter_names}
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        self._handles, self._hooks, self._requires_update = {}, [], []
        self._synchronized, self._should_synchronize = False, True
        if hvd.size() > 1:
            self._register_hooks()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized, self._should_synchronize = False, True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.append(p)
                    # the hook of the gradient accumulator: after p.grad holds this pass's sum
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def _make_hook(self):
        def hook(p):
            if p in self._handles and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            self._allreduce_delay[p] -= 1
            self._handles[p] = self._allreduce_delay[p] == 0  # ready to reduce
        return hook

    def synchronize(self):
        """Reduce every parameter's gradient now (a parameter with none: zeros), in the
        parameters' name order, coalesced per dtype and device."""
        params = sorted(self._requires_update, key=lambda p: self._parameter_names[p])
        for p in params:
            if p.grad is None:
                p.grad = p.data.new(p.size()).zero_()
        if self.op == hvd.Average:  # Horovod splits the average around the sum
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            pre = post = 1.0
        buckets = collections.defaultdict(list)
        for p in params:
            dense = p.grad.to_dense() if p.grad.is_sparse else p.grad
            wire, ctx = self._compression.compress(dense)
            buckets[(wire.dtype, wire.device)].append((p, wire, ctx))
        for items in buckets.values():
            wires = [wire for _, wire, _ in items]
            flat = _flatten_dense_tensors(wires)
            hvd.allreduce_(flat, op=self.op, prescale_factor=pre, postscale_factor=post)
            for (p, _, ctx), out in zip(items, _unflatten_dense_tensors(flat, wires),
                                        strict=True):
                got = self._compression.decompress(out, ctx)
                if p.grad.is_sparse:
                    p.grad.zero_().add_(got.to_sparse())
                else:
                    p.grad.copy_(got)
        for p in params:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """optimizer.step() without its synchronize(), after the script called it itself."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,  # noqa: N802
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set):
    """`optimizer` whose step() first reduces the gradients across the ranks (Horovod's).
    `groups`/`num_groups` only group Horovod's calls, and every gradient is coalesced here
    anyway: accepted, with the same result."""
    hvd.global_only(process_set)
    if op == hvd.Adasum:
        hvd.not_provided("Adasum (op=hvd.Adasum)")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression or hvd.Compression.none,
               backward_passes_per_step, op, gradient_predivide_factor)


def broadcast_parameters(params, root_rank):
    """Broadcast a state_dict, named_parameters() or a list of tensors from `root_rank`."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [hvd.broadcast_async_(p, root_rank, name) for name, p in params]
    for h in handles:
        hvd.synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """The optimizer's state and options from `root_rank`. A fresh optimizer first takes one
    step on zero gradients (without a reduction), so that its state exists: Adam's step is
    then 1, as with Horovod."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                            isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                        p.grad = p.grad.to_sparse()
        if getattr(optimizer, "_kfvision_hvd", False):
            super(optimizer.__class__, optimizer).step()
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return
    tensors, scalars, callbacks = [], {}, {}
    seen = collections.defaultdict(int)
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                callbacks[f"{key}.{index}"] = _set_option(optimizer, index, key)
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                seen[name] += 1
                key = f"{name}.{seen[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    callbacks[key] = _set_state(state_dict, pid, name)
    broadcast_parameters(tensors, root_rank)
    for key, value in hvd.broadcast_object(scalars, root_rank).items():
        callbacks[key](value)


def _set_option(optimizer, index, key):
    def assign(value):
        optimizer.param_groups[index][key] = value
    return assign


def _set_state(state_dict, pid, name):
    def assign(value):
        state_dict["state"][pid][name] = value
    return assign
