"""Convolutions whose output is a single pixel, computed as one matrix multiply (CPU fast path).

Why by hand: in training, PyTorch keeps convolution weights in the plain OIHW layout, and oneDNN
re-lays them out into its blocked layouts on every call (forward, backward-data) and lays the
weight gradient back out afterwards. When a convolution's output is one pixel (resnet's last stage
on 32 px images: a 3x3 convolution over a 1x1 input), the arithmetic is tiny and those re-layouts
of a 9 MB weight are most of the time: ONEDNN_VERBOSE showed 3-7x more time in reorders than in
the convolution itself (docs/benchmarks.md). No library offers "skip the reorder for this layer".

The identity used is exact: an output pixel sees one window of the input; taps of the kernel that
fall on zero padding contribute nothing. So the convolution is `linear(window, weight taps over the
window)`, and the weight gradient of the padding taps is exactly zero, as in the convolution.
Results differ from oneDNN's only by floating-point summation order.

Only modules whose class is exactly `nn.Conv2d` are converted (by swapping their class, so
parameters, state_dict keys, `isinstance` checks and DDP see the same module); every other shape,
dilation, groups, padding mode or a string padding goes to `nn.Conv2d.forward` unchanged.

Training at a known image size (`train_only_live_taps`) goes one step further. A one-pixel output
only ever uses the taps over its window (the centre tap of a 3x3 kernel over a 1x1 input): the
other taps multiply zero padding, get a gradient of exactly zero and never change the output at
that size. Training then keeps only the live taps as the parameter (1 of 9 for resnet18's last
stage: 1 MB instead of 9.4 MB per layer), so the weight gradient, the optimiser step and DDP's
all-reduce handle a ninth of the bytes. The dead taps stay as they were (plain SGD would only
shrink them by weight decay, with no effect on the outputs at that size); `state_dict` and
`load_state_dict` still read and write the whole kernel under the usual key.
"""

import torch
from torch import nn


class _WindowGemm(torch.autograd.Function):
    """`window @ taps.T`, where taps are the kernel taps over the input window.

    Autograd of "slice the taps, reshape, linear" would build the weight gradient as a zero tensor
    plus a strided copy of the taps' gradient: two more passes over the (large) weight. Here the
    gradient is one GEMM against the window spread over the whole kernel (activation-sized, small),
    which writes the weight gradient once.
    """

    @staticmethod
    def forward(ctx, window, weight, rows: slice, cols: slice):
        taps = weight[:, :, rows, cols].reshape(weight.shape[0], -1)
        ctx.save_for_backward(window, taps)
        ctx.geometry = (weight.shape, rows, cols)
        return window @ taps.T

    @staticmethod
    def backward(ctx, grad):
        window, taps = ctx.saved_tensors
        (o, c, kh, kw), rows, cols = ctx.geometry
        grad_window = grad @ taps if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            n = window.shape[0]
            spread = window.new_zeros(n, c, kh, kw)
            spread[:, :, rows, cols] = window.view(n, c, rows.stop - rows.start,
                                                   cols.stop - cols.start)
            grad_weight = (grad.T @ spread.view(n, -1)).view(o, c, kh, kw)
        return grad_window, grad_weight, None, None


class SinglePixelGemmConv2d(nn.Conv2d):
    """`nn.Conv2d` that runs as one GEMM when its output is 1x1 (see module docstring)."""

    live = None  # with live taps only: (input height, width, kernel rows, kernel columns)

    def forward(self, x):
        if self.live is not None:
            return self._forward_live_taps(x)
        window = self.single_pixel_window(x.shape[-2], x.shape[-1])
        if window is None:
            return super().forward(x)
        r0, r1, c0, c1 = window
        ph, pw = self.padding
        rows, cols = slice(r0 + ph, r1 + ph), slice(c0 + pw, c1 + pw)
        return self._one_pixel(x, window, self.weight,
                               lambda win, weight: _WindowGemm.apply(win, weight, rows, cols))

    def _forward_live_taps(self, x):
        h, w, _, _ = self.live
        if tuple(x.shape[-2:]) != (h, w):  # another size: the whole kernel, as a convolution
            return self._conv_forward(x, self.kernel(), self.bias)
        return self._one_pixel(x, self.single_pixel_window(h, w), self.weight_taps,
                               lambda win, taps: nn.functional.linear(
                                   win, taps.reshape(taps.shape[0], -1)))

    def _one_pixel(self, x, window, weight, product):
        """`product(flattened input window, weight)` (+ bias) as the N x C x 1 x 1 output."""
        r0, r1, c0, c1 = window
        win = x[:, :, r0:r1, c0:c1].reshape(x.shape[0], -1)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as autocast does for a convolution
            dtype = torch.get_autocast_dtype(device)
            win, weight = win.to(dtype), weight.to(dtype)
        out = product(win, weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(x.shape[0], self.out_channels, 1, 1)

    def kernel(self) -> torch.Tensor:
        """The whole weight; with live taps only, the dead taps with the live ones in place."""
        if self.live is None:
            return self.weight
        _, _, rows, cols = self.live
        kernel = self.dead_taps.clone()
        kernel[:, :, rows, cols] = self.weight_taps
        return kernel

    def keep_only_live_taps(self, h: int, w: int) -> bool:
        """Make the taps this layer uses on an h x w input its only trained parameter (module
        docstring); False (nothing changed) when there are no dead taps at that size."""
        window = self.single_pixel_window(h, w)
        if window is None or self.live is not None:
            return False
        r0, r1, c0, c1 = window
        (ph, pw), (kh, kw) = self.padding, self.kernel_size
        rows, cols = slice(r0 + ph, r1 + ph), slice(c0 + pw, c1 + pw)
        if (r1 - r0, c1 - c0) == (kh, kw):
            return False
        weight = self._parameters.pop("weight").detach()
        self.weight_taps = nn.Parameter(weight[:, :, rows, cols].contiguous())
        self.dead_taps = weight  # a plain attribute: not trained, not broadcast by DDP
        self.live = (h, w, rows, cols)
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.live is not None:  # the usual key and shape: the whole kernel
            destination.pop(prefix + "weight_taps")
            kernel = self.kernel()
            destination[prefix + "weight"] = kernel if keep_vars else kernel.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if self.live is not None and key in state_dict:
            kernel = state_dict[key]
            if kernel.shape == self.dead_taps.shape:
                _, _, rows, cols = self.live
                with torch.no_grad():
                    self.dead_taps.copy_(kernel)
                state_dict[prefix + "weight_taps"] = kernel[:, :, rows, cols]
            else:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(kernel.shape)}, the shape in current model is "
                                  f"{tuple(self.dead_taps.shape)}.")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.live is not None:
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if prefix + "weight_taps" in missing_keys:  # named as the caller knows it
                missing_keys[missing_keys.index(prefix + "weight_taps")] = key

    def single_pixel_window(self, h: int, w: int):
        """(row0, row1, col0, col1) of the input the single output pixel sees, or None when the
        output is larger than one pixel or the convolution is of a kind not handled here."""
        if (self.groups != 1 or self.dilation != (1, 1) or self.padding_mode != "zeros"
                or isinstance(self.padding, str)):
            return None
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        if (h + 2 * ph - kh) // sh + 1 != 1 or (w + 2 * pw - kw) // sw + 1 != 1:
            return None
        r0, r1, c0, c1 = max(0, -ph), min(h, kh - ph), max(0, -pw), min(w, kw - pw)
        return (r0, r1, c0, c1) if r1 > r0 and c1 > c0 else None


def use_gemm_for_single_pixel_outputs(model: nn.Module) -> int:
    """Convert the model's plain `nn.Conv2d` modules in place; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Conv2d:
            m.__class__ = SinglePixelGemmConv2d
            n += 1
    return n


def train_only_live_taps(model: nn.Module, image_size: int) -> int:
    """Keep only the live taps as parameters (module docstring) in every converted convolution
    whose output is one pixel for `image_size` inputs; returns how many. Found with one forward
    pass of a blank image (eval mode, no gradient). Call before the optimiser and DDP see the
    parameters."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, args[0].shape[-2:])))
             for m in model.modules() if isinstance(m, SinglePixelGemmConv2d)]
    training = model.training
    try:
        p = next(model.parameters())
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, image_size, image_size, device=p.device, dtype=p.dtype))
    finally:
        for h in hooks:
            h.remove()
        model.train(training)
    return sum(m.keep_only_live_taps(int(h), int(w)) for m, (h, w) in seen)
