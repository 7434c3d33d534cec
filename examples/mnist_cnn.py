"""The classic first distributed-training example: a 3-conv CNN for MNIST (1 x 28 x 28, 10 classes).

Plan it without a GPU and without allocating it (parameters and activations are measured on fake
tensors):

    distplan estimate --module examples.mnist_cnn:make_model --input-shape 128,1,28,28 --precision fp32 --optimizer adam

Train it with Adam as PyTorch's DDP tutorial does: `torch.optim.Adam(model.parameters(), lr=1e-3)` and
`F.cross_entropy(model(x), y)`.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class MnistCNN(nn.Module):
    """conv(1->32) -> pool -> conv(32->64) -> pool -> conv(64->128) -> pool -> fc(1152->256) -> fc(256->10)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(128 * 3 * 3, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 28, 28)
        x = self.pool(F.relu(self.conv1(x)))  # (B, 32, 14, 14)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 64, 7, 7)
        x = self.pool(F.relu(self.conv3(x)))  # (B, 128, 3, 3)
        x = torch.flatten(x, 1)  # (B, 1152)
        x = F.relu(self.fc1(x))  # (B, 256)
        return self.fc2(x)  # (B, 10) logits


def make_model() -> nn.Module:
    return MnistCNN()
