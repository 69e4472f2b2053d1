"""J7's model (issue 47): a decoder block as a Flax linen user writes it, channels last, with no
fastbwd in it (``fastbwd.jax.reach`` brings it to fastbwd's kernels)."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class Decoder(nn.Module):
    """GroupNorm -> swish -> conv 3x3 -> bilinear x2 -> avg-pool 3x3 "SAME" -> edge pad 1 -> conv
    3x3 "VALID", NHWC."""

    features: int

    @nn.compact
    def __call__(self, x):
        h = nn.swish(nn.GroupNorm(num_groups=32)(x))
        h = nn.Conv(self.features, (3, 3))(h)
        n, height, width, channels = h.shape
        h = jax.image.resize(h, (n, 2 * height, 2 * width, channels), "bilinear")
        h = nn.avg_pool(h, (3, 3), (1, 1), "SAME")
        h = jnp.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
        return nn.Conv(self.features, (3, 3), padding="VALID")(h)
