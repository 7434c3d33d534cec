"""A small ResNet for CIFAR-10 (3 x 32 x 32, 10 classes): BatchNorm, residual blocks, strided convolutions.

A second convolutional model for `--module`, beside the MNIST CNN, with what that one lacks: BatchNorm
(running statistics are buffers, and its backward saves the normalized input), skip connections inside
a unit (the block's input gradient is the sum of two paths), 1x1 strided projections and global pooling.
The layout follows He et al. 2016 ("Deep Residual Learning", the CIFAR ResNets: 3x3 stem, stages of
basic blocks at 16/32/64 channels), with one block per stage to stay small.

    distplan estimate --module examples.cifar_resnet:make_model --input-shape 128,3,32,32 --optimizer sgd-momentum
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the input (projected by a strided 1x1 conv + BN when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """stem (3->16) -> block(16) -> block(16->32, /2) -> block(32->64, /2) -> global pool -> fc(64->10)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, 2)
        self.layer3 = BasicBlock(32, 64, 2)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, 32, 32)
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))  # (B, 64, 8, 8)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (B, 64)
        return self.fc(x)


def make_model() -> nn.Module:
    return CifarResNet()
