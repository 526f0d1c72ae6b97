"""ResNet-50 with torchvision's shapes, written with plain torch modules.

Follows torchvision/models/resnet.py (``ResNet``, ``Bottleneck``, ``resnet50``): the v1.5
bottleneck with the stride on the 3x3 convolution, BatchNorm after every convolution (running
statistics updated in train mode), in-place ReLU, a 1x1 projection shortcut on the first block
of each stage, global average pooling and a 1000-way linear head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ResNet", "ResNetShape", "resnet_buffer_count", "resnet_parameter_count"]

_EXPANSION = 4  # torchvision Bottleneck.expansion
_WIDTHS = (64, 128, 256, 512)  # torchvision ResNet._make_layer planes per stage


@dataclass(frozen=True)
class ResNetShape:
    """The sizes of a bottleneck ResNet.

    Attributes:
        blocks: bottleneck blocks per stage; (3, 4, 6, 3) is ResNet-50.
        classes: ``num_classes``.
    """

    blocks: tuple[int, int, int, int] = (3, 4, 6, 3)
    classes: int = 1000


def _convs(shape: ResNetShape) -> list[tuple[int, int, int]]:
    """(in channels, out channels, kernel) of every convolution, in order."""
    convs = [(3, 64, 7)]
    inplanes = 64
    for width, count in zip(_WIDTHS, shape.blocks, strict=True):
        for block in range(count):
            out = width * _EXPANSION
            convs += [(inplanes, width, 1), (width, width, 3), (width, out, 1)]
            if block == 0:
                convs.append((inplanes, out, 1))  # downsample
            inplanes = out
    return convs


def resnet_parameter_count(shape: ResNetShape) -> int:
    """Parameters by arithmetic: bias-free convolutions, BatchNorm weight+bias, the head."""
    convs = _convs(shape)
    conv_params = sum(cin * cout * k * k for cin, cout, k in convs)
    bn_params = sum(2 * cout for _, cout, _ in convs)
    features = _WIDTHS[-1] * _EXPANSION
    return conv_params + bn_params + features * shape.classes + shape.classes


def resnet_buffer_count(shape: ResNetShape) -> tuple[int, int]:
    """Buffer elements: BatchNorm running mean and var (float), one num_batches_tracked (int64)."""
    convs = _convs(shape)
    return sum(2 * cout for _, cout, _ in convs), len(convs)


class _Bottleneck(nn.Module):
    def __init__(self, inplanes: int, width: int, stride: int, downsample: bool) -> None:
        super().__init__()
        out = width * _EXPANSION
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        y += identity
        return self.relu(y)


class ResNet(nn.Module):
    """Bottleneck ResNet classifier returning logits ``[batch, classes]``."""

    def __init__(self, shape: ResNetShape) -> None:
        super().__init__()
        self.shape = shape
        self.checkpointing = False
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        blocks: list[nn.Module] = []
        inplanes = 64
        for stage, (width, count) in enumerate(zip(_WIDTHS, shape.blocks, strict=True)):
            for block in range(count):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(_Bottleneck(inplanes, width, stride, downsample=block == 0))
                inplanes = width * _EXPANSION
        self.blocks = nn.ModuleList(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, shape.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits for ``images`` ``[batch, 3, height, width]``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))
