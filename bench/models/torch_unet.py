"""The small UNet of benchmark T7 (bench/bench_torch.py and ``python3 -m bench``), written the way
diffusion models write theirs: residual blocks that call GroupNorm, SiLU and conv in
``forward()`` (the activation a module attribute in one place, ``F.silu`` in another), an
optional time embedding, avg-pool downsampling and bilinear upsampling. Nothing in it knows
about fastbwd: ``fastbwd.torch.fuse_group_norm_swish`` finds the pairs by watching a forward."""

import torch
from torch import nn
from torch.nn import functional as F


class ResnetBlock(nn.Module):
    def __init__(self, in_channels, out_channels, temb_channels, groups):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nonlinearity = nn.SiLU()
        self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, input_tensor, temb=None):
        hidden = self.norm1(input_tensor)
        hidden = self.nonlinearity(hidden)
        hidden = self.conv1(hidden)
        if temb is not None:
            hidden = hidden + self.time_emb_proj(self.nonlinearity(temb))[:, :, None, None]
        hidden = self.norm2(hidden)
        hidden = F.silu(hidden)
        hidden = self.conv2(hidden)
        if self.conv_shortcut is not None:
            input_tensor = self.conv_shortcut(input_tensor)
        return input_tensor + hidden


class SmallUNet(nn.Module):
    """``channels[i]`` per level: one residual block per level down (then avg-pool 2x2), one in
    the middle, one per level up (after bilinear x2 and the skip concatenation), and an output
    GroupNorm + SiLU + conv. ``2 * (2 * len(channels) + 1) + 1`` GroupNorms, each followed by
    SiLU."""

    def __init__(self, in_channels=3, channels=(32, 64, 128), temb_channels=128, groups=16):
        super().__init__()
        self.temb_channels = temb_channels
        self.time_mlp = nn.Sequential(
            nn.Linear(temb_channels, temb_channels), nn.SiLU(), nn.Linear(temb_channels, temb_channels)
        )
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        previous = channels[0]
        for width in channels:
            self.down.append(ResnetBlock(previous, width, temb_channels, groups))
            previous = width
        self.mid = ResnetBlock(previous, previous, temb_channels, groups)
        self.up = nn.ModuleList()
        for width in reversed(channels):
            self.up.append(ResnetBlock(previous + width, width, temb_channels, groups))
            previous = width
        self.norm_out = nn.GroupNorm(groups, previous)
        self.conv_out = nn.Conv2d(previous, in_channels, 3, padding=1)

    def forward(self, x, temb=None):
        if temb is not None:
            temb = self.time_mlp(temb)
        hidden = self.conv_in(x)
        skips = []
        for block in self.down:
            hidden = block(hidden, temb)
            skips.append(hidden)
            hidden = F.avg_pool2d(hidden, 2)
        hidden = self.mid(hidden, temb)
        for block in self.up:
            hidden = F.interpolate(hidden, scale_factor=2, mode="bilinear", align_corners=False)
            hidden = block(torch.cat([hidden, skips.pop()], dim=1), temb)
        return self.conv_out(F.silu(self.norm_out(hidden)))
