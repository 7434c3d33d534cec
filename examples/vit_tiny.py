"""A small Vision Transformer for CIFAR-10 (3 x 32 x 32, 10 classes) built from torch's own
`nn.TransformerEncoderLayer` (multi-head attention, LayerNorm, GELU, dropout), its blocks in an
`nn.ModuleList`: the `--module` units are the list's blocks (a container without forward is never a unit).

    distplan validate --module examples.vit_tiny:make_model --input-shape 32,3,32,32 --simulate-world-size 8
"""
import torch
from torch import nn

class ViT(nn.Module):
    def __init__(self, dim=192, depth=6, heads=3, patch=4, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, 65, dim))
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                                                batch_first=True, norm_first=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x[:, 0]))

def make_model():
    return ViT()


def make_deep() -> nn.Module:
    """ViT-S/4 depth: 16 blocks of width 384 (6 heads), about 28M parameters; the GPU plan's `--module` model
    at depth (.ci/gpu-plan.yaml)."""
    return ViT(dim=384, depth=16, heads=6)
