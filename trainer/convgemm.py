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

    def forward(self, x):
        window = self.single_pixel_window(x.shape[-2], x.shape[-1])
        if window is None:
            return super().forward(x)
        r0, r1, c0, c1 = window
        ph, pw = self.padding
        window, weight = x[:, :, r0:r1, c0:c1].reshape(x.shape[0], -1), self.weight
        device = x.device.type
        if torch.is_autocast_enabled(device):  # as autocast does for a convolution
            dtype = torch.get_autocast_dtype(device)
            window, weight = window.to(dtype), weight.to(dtype)
        out = _WindowGemm.apply(window, weight, slice(r0 + ph, r1 + ph), slice(c0 + pw, c1 + pw))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(x.shape[0], self.out_channels, 1, 1)

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
