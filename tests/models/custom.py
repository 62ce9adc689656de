"""Hand-written (non-HF) models for the conversion tests: an MLP, a CNN with BatchNorm, a transformer block."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A hand-written pre-norm transformer block: heads from `n_heads` / `head_dim` attributes."""

    def __init__(self, dim: int = 48, n_heads: int = 6, hidden: int = 80):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, s, -1, self.head_dim).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def mlp() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 12), nn.Tanh(), nn.Linear(12, 7))


def cnn() -> nn.Sequential:
    torch.manual_seed(6)
    return nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                         nn.Conv2d(12, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def block() -> Block:
    torch.manual_seed(8)
    return Block()


def clone(m: nn.Module) -> nn.Module:
    return copy.deepcopy(m)
