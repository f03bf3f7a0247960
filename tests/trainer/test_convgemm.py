"""One-pixel-output convolutions as one GEMM (trainer/model/convgemm.py) match nn.Conv2d."""

import copy

import pytest
import torch
import torchvision
from torch import nn

from kfvision.trainer.model.convgemm import (
    SinglePixelGemmConv2d,
    train_only_live_taps,
    use_gemm_for_single_pixel_outputs,
)


def _gemm_copy(module):
    other = copy.deepcopy(module)
    use_gemm_for_single_pixel_outputs(other)
    return other


def _forward_backward(module, x):
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    y = module(x)
    (y.float() ** 2).sum().backward()
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


# (in, out, kernel, stride, padding, bias), input (h, w), whether the output is one pixel
@pytest.mark.parametrize("conv, hw, one_pixel", [
    ((16, 24, 3, 1, 1, False), (1, 1), True),    # resnet's last stage on 32 px images
    ((16, 24, 3, 2, 1, False), (2, 2), True),    # its strided first block
    ((16, 24, 1, 2, 0, False), (2, 2), True),    # and the downsample shortcut
    ((16, 24, 3, 1, 0, True), (3, 3), True),     # a window without padding, with bias
    ((16, 24, (3, 5), 1, (1, 2), True), (1, 1), True),
    ((16, 24, 3, 2, 1, True), (1, 2), True),     # not square
    ((16, 24, 3, 3, 1, True), (3, 3), True),     # window cut by padding on one side only
    ((16, 24, 3, 1, 1, True), (4, 4), False),    # larger outputs: nn.Conv2d itself
    ((16, 24, 7, 2, 3, False), (3, 3), False),
])
def test_a_converted_convolution_gives_the_same_outputs_and_gradients(conv, hw, one_pixel):
    torch.manual_seed(0)
    ci, co, k, s, p, bias = conv
    plain = nn.Conv2d(ci, co, k, s, p, bias=bias)
    gemm = _gemm_copy(plain)
    assert isinstance(gemm, SinglePixelGemmConv2d)
    assert (gemm.single_pixel_window(*hw) is not None) is one_pixel
    x = torch.randn(5, ci, *hw)
    for a, b in zip(_forward_backward(plain, x)[:2], _forward_backward(gemm, x)[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(_forward_backward(plain, x)[2], _forward_backward(gemm, x)[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kinds_it_does_not_handle_stay_convolutions():
    x = torch.randn(2, 8, 1, 1)
    for conv in (nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.Conv2d(8, 8, 3, padding="same"),
                 nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
                 nn.Conv2d(8, 8, 3, padding=2, dilation=2)):
        gemm = _gemm_copy(conv)
        assert gemm.single_pixel_window(1, 1) is None
        if conv.padding_mode != "reflect":  # reflect padding needs a larger input
            torch.testing.assert_close(gemm(x), conv(x))


@pytest.mark.parametrize("arch", ["resnet18", "densenet121"])
def test_a_whole_network_on_32px_images_is_as_exact_as_the_convolutions(arch):
    torch.manual_seed(0)
    plain = torchvision.models.get_model(arch, num_classes=10)
    gemm = _gemm_copy(plain)
    assert use_gemm_for_single_pixel_outputs(copy.deepcopy(plain)) == sum(
        type(m) is nn.Conv2d for m in plain.modules())
    assert list(gemm.state_dict()) == list(plain.state_dict())  # same checkpoint, same export
    x = torch.randn(4, 3, 32, 32)
    exact = _forward_backward(copy.deepcopy(plain).double(), x.double())
    # batch norm over a handful of 1x1 pixels amplifies rounding (densenet's last block: ~2% off
    # float64 even for nn.Conv2d), so the bar is: no further from float64 than oneDNN itself
    for ours, reference, truth in zip(_flat(_forward_backward(gemm, x)),
                                      _flat(_forward_backward(plain, x)), _flat(exact)):
        error = (ours.double() - truth).norm() / truth.norm()
        assert error <= 2 * (reference.double() - truth).norm() / truth.norm() + 1e-6


def _flat(result):
    y, x_grad, grads = result
    return [y, x_grad, *grads]


def test_under_bf16_autocast_it_follows_the_convolution():
    torch.manual_seed(0)
    plain = nn.Conv2d(64, 32, 3, 1, 1)
    gemm = _gemm_copy(plain)
    x = torch.randn(8, 64, 1, 1)
    results = []
    for module in (plain, gemm):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_forward_backward(module, x))
    (ya, gxa, gpa), (yb, gxb, gpb) = results
    assert ya.dtype == yb.dtype == torch.bfloat16
    assert gpb[0].dtype == torch.float32  # the weights' gradient stays float32
    for a, b in [(ya, yb), (gxa, gxb), *zip(gpa, gpb)]:
        assert (a.float() - b.float()).norm() <= 2e-2 * a.float().norm()


def _sgd_steps(model, x, y, steps=3):
    from kfvision.trainer.engine import make_sgd

    opt = make_sgd(model, 0.05, 0.9, 0.0)  # no weight decay: dead taps then stay put in both
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def test_training_only_the_live_taps_trains_the_same_model():
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10).double()
    live = _gemm_copy(plain)
    # resnet18 at 32 px: layer4's first conv sees 2x2 of its 3x3 taps, the other three 1 of 9
    assert train_only_live_taps(live, 32) == 4
    assert sum(p.numel() for p in live.parameters()) < 0.4 * sum(
        p.numel() for p in plain.parameters())
    x, y = torch.randn(8, 3, 32, 32, dtype=torch.double), torch.randint(0, 10, (8,))
    opt = _sgd_steps(plain, x, y)
    _sgd_steps(live, x, y)
    ours, theirs = live.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)  # same keys, same order: checkpoints and weights.pt as ever
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-7, atol=1e-9, msg=k)
    plain.eval(), live.eval()
    with torch.no_grad():  # and at another size the whole kernel is used, as a convolution
        for size in (32, 64):
            z = torch.randn(2, 3, size, size, dtype=torch.double)
            torch.testing.assert_close(live(z), plain(z))
    assert len(opt.param_groups[0]["params"]) == len(list(plain.parameters()))


def test_a_live_taps_model_loads_and_gives_back_whole_kernels():
    torch.manual_seed(0)
    trained = torchvision.models.resnet18(num_classes=10)
    state = {k: v + 0.5 for k, v in trained.state_dict().items() if v.is_floating_point()}
    live = _gemm_copy(torchvision.models.resnet18(num_classes=10))
    train_only_live_taps(live, 32)
    live.load_state_dict({**trained.state_dict(), **state})  # e.g. resuming a checkpoint
    for k, v in live.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(v, state[k]), k
    fresh = torchvision.models.resnet18(num_classes=10)
    fresh.load_state_dict(live.state_dict())  # e.g. scoring with weights.pt
    partial = {k: v for k, v in live.state_dict().items() if k != "layer4.1.conv2.weight"}
    assert live.load_state_dict(partial, strict=False).missing_keys == ["layer4.1.conv2.weight"]
    with pytest.raises(RuntimeError, match="size mismatch for layer4.1.conv2.weight"):
        live.load_state_dict({**live.state_dict(),
                              "layer4.1.conv2.weight": torch.zeros(512, 512, 1, 1)})
