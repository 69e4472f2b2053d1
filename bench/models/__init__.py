"""Models the benchmarks and tests train, written as the libraries they stand for write theirs
(``torch_unet``: T7's small UNet; ``torch_diffusion``: T8's diffusion UNet; ``flax_decoder``:
J7's Flax decoder block; ``equinox_resnet``: J8's Equinox ResNet block)."""
