"""J8's model (issue 47): a ResNet block as an Equinox user writes it, one example channels first
(batched by ``jax.vmap``), with no fastbwd in it (``fastbwd.jax.reach`` brings it to fastbwd)."""

import equinox as eqx
import jax


class ResBlock(eqx.Module):
    """GroupNorm(32) -> swish -> conv 3x3, twice, and the residual."""

    norm1: eqx.nn.GroupNorm
    conv1: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d

    def __init__(self, channels, key):
        first, second = jax.random.split(key)
        self.norm1 = eqx.nn.GroupNorm(32, channels)
        self.conv1 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=first)
        self.norm2 = eqx.nn.GroupNorm(32, channels)
        self.conv2 = eqx.nn.Conv2d(channels, channels, 3, padding=1, key=second)

    def __call__(self, x):
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return x + h
