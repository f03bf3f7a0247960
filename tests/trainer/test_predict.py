"""The forward pass serving runs (`kfvision.trainer.use.predict.inference_net`): faster, same
answers."""

import torch
from torch import nn
from torchvision.models import resnet18

from kfvision.trainer.use.predict import inference_net


def test_batchnorm_is_folded_and_the_output_is_the_modules_own():
    torch.manual_seed(0)
    net = resnet18(num_classes=10)
    for m in net.modules():  # BatchNorm statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    net.eval()
    fast = inference_net(net)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fast.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())  # the model is untouched
    x = torch.randn(4, 3, 64, 64)
    with torch.inference_mode():
        want = net(x).softmax(1)
        got = fast(x.contiguous(memory_format=torch.channels_last)).softmax(1)
    assert (got - want).abs().max() < 1e-5


class Branchy(nn.Module):
    """Control flow on a tensor's value: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return y if y.sum() > 0 else -y


def test_a_model_fx_cannot_trace_is_served_unfused():
    net = Branchy().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        want = net(x)
        fast = inference_net(net)
        assert torch.allclose(fast(x), want, atol=1e-6)
    assert any(isinstance(m, nn.BatchNorm2d) for m in fast.modules())
