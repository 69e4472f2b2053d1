"""Models written the way diffusion and segmentation libraries write theirs (our own code, with
their patterns), for benchmark T8 (bench/torch_cases.py) and the fusion tests
(tests/test_fuse_real_models.py). Nothing here knows about fastbwd.

The patterns: ``forward(self, input_tensor, temb, *args, **kwargs)`` with a deprecation check
on ``scale``; ONE ``nn.SiLU`` module shared by the block's norms and its time embedding; a
branch on ``h.shape[0]``; optional up/down-sampling; ``time_embedding_norm`` "default" (a
GroupNorm -> SiLU pair) or "scale_shift" (scale and shift between the norm and the activation,
not a pair); dropout; an ``output_scale_factor``; attention whose GroupNorm feeds a reshape;
blocks returning tuples of skip states; a top-level forward with a configuration check on the
input's shape (which symbolic tracing cannot evaluate) returning a dataclass; and a
segmentation decoder of conv-norm-activation modules that loop over an ``order``.
"""

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def deprecate(name, version, message):
    """A library's deprecation helper: warns, and the caller then ignores the argument."""
    warnings.warn(f"`{name}` is deprecated and will be removed in version {version}. {message}", FutureWarning, 3)


# ---- resnet, attention, resampling -----------------------------------------------------------


class Upsample2D(nn.Module):
    def __init__(self, channels, use_conv=True, interpolate=True):
        super().__init__()
        self.channels = channels
        self.interpolate = interpolate
        self.conv = nn.Conv2d(channels, channels, 3, padding=1) if use_conv else None

    def forward(self, hidden_states, output_size=None, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", "The `scale` argument is ignored.")
        assert hidden_states.shape[1] == self.channels
        if self.interpolate:
            if output_size is None:
                hidden_states = F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")
            else:
                hidden_states = F.interpolate(hidden_states, size=output_size, mode="nearest")
        if self.conv is not None:
            hidden_states = self.conv(hidden_states)
        return hidden_states


class Downsample2D(nn.Module):
    def __init__(self, channels, use_conv=True, padding=1):
        super().__init__()
        self.channels = channels
        self.padding = padding
        if use_conv:
            self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=padding)
        else:
            self.conv = nn.AvgPool2d(kernel_size=2, stride=2)

    def forward(self, hidden_states, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", "The `scale` argument is ignored.")
        assert hidden_states.shape[1] == self.channels
        if isinstance(self.conv, nn.Conv2d) and self.padding == 0:
            hidden_states = F.pad(hidden_states, (0, 1, 0, 1), mode="constant", value=0)
        return self.conv(hidden_states)


class ResnetBlock2D(nn.Module):
    def __init__(
        self,
        *,
        in_channels,
        out_channels=None,
        temb_channels=512,
        groups=32,
        groups_out=None,
        eps=1e-6,
        dropout=0.0,
        time_embedding_norm="default",
        output_scale_factor=1.0,
        up=False,
        down=False,
        use_in_shortcut=None,
    ):
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        self.in_channels, self.out_channels = in_channels, out_channels
        self.time_embedding_norm = time_embedding_norm
        self.output_scale_factor = output_scale_factor
        groups_out = groups if groups_out is None else groups_out

        self.norm1 = nn.GroupNorm(num_groups=groups, num_channels=in_channels, eps=eps, affine=True)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if temb_channels is not None:
            if time_embedding_norm == "default":
                self.time_emb_proj = nn.Linear(temb_channels, out_channels)
            elif time_embedding_norm == "scale_shift":
                self.time_emb_proj = nn.Linear(temb_channels, 2 * out_channels)
            else:
                raise ValueError(f"unknown time_embedding_norm : {time_embedding_norm}")
        else:
            self.time_emb_proj = None
        self.norm2 = nn.GroupNorm(num_groups=groups_out, num_channels=out_channels, eps=eps, affine=True)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.nonlinearity = nn.SiLU()

        self.upsample = self.downsample = None
        if up:
            self.upsample = Upsample2D(in_channels, use_conv=False)
        elif down:
            self.downsample = Downsample2D(in_channels, use_conv=False, padding=1)

        self.use_in_shortcut = in_channels != out_channels if use_in_shortcut is None else use_in_shortcut
        self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1) if self.use_in_shortcut else None

    def forward(self, input_tensor, temb, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", "The `scale` argument is ignored.")

        hidden_states = input_tensor
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.nonlinearity(hidden_states)

        if self.upsample is not None:
            # upsample_nearest_nhwc fails with large batch sizes
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        hidden_states = self.conv1(hidden_states)

        if self.time_emb_proj is not None:
            temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]

        if self.time_embedding_norm == "default":
            if temb is not None:
                hidden_states = hidden_states + temb
            hidden_states = self.norm2(hidden_states)
        elif self.time_embedding_norm == "scale_shift":
            if temb is None:
                raise ValueError(f"`temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}")
            time_scale, time_shift = torch.chunk(temb, 2, dim=1)
            hidden_states = self.norm2(hidden_states)
            hidden_states = hidden_states * (1 + time_scale) + time_shift

        hidden_states = self.nonlinearity(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)

        if self.conv_shortcut is not None:
            input_tensor = self.conv_shortcut(input_tensor.contiguous())

        output_tensor = (input_tensor + hidden_states) / self.output_scale_factor
        return output_tensor


class Attention(nn.Module):
    """Spatial self-attention with a GroupNorm in front (its output is reshaped: not a pair)."""

    def __init__(self, query_dim, heads=1, dim_head=None, norm_num_groups=32, eps=1e-6, rescale_output_factor=1.0):
        super().__init__()
        dim_head = query_dim // heads if dim_head is None else dim_head
        inner_dim = dim_head * heads
        self.heads = heads
        self.rescale_output_factor = rescale_output_factor
        self.group_norm = nn.GroupNorm(num_channels=query_dim, num_groups=norm_num_groups, eps=eps, affine=True)
        self.to_q = nn.Linear(query_dim, inner_dim)
        self.to_k = nn.Linear(query_dim, inner_dim)
        self.to_v = nn.Linear(query_dim, inner_dim)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(0.0)])

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **cross_attention_kwargs):
        unused = [k for k in cross_attention_kwargs if k not in ("scale", "temb")]
        if unused:
            warnings.warn(f"cross_attention_kwargs {unused} are not expected and will be ignored.", UserWarning, 2)
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size = hidden_states.shape[0]
        if self.group_norm is not None:
            hidden_states = self.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = self.to_q(hidden_states)
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // self.heads
        query = query.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        hidden_states = hidden_states + residual
        return hidden_states / self.rescale_output_factor


# ---- UNet blocks ------------------------------------------------------------------------------


class DownBlock2D(nn.Module):
    def __init__(self, in_channels, out_channels, temb_channels, num_layers, groups, add_downsample, dropout, norm):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock2D(
                in_channels=in_channels if i == 0 else out_channels,
                out_channels=out_channels,
                temb_channels=temb_channels,
                groups=groups,
                dropout=dropout,
                time_embedding_norm=norm,
            )
            for i in range(num_layers)
        )
        self.downsamplers = nn.ModuleList([Downsample2D(out_channels, use_conv=True)]) if add_downsample else None
        self.gradient_checkpointing = False

    def forward(self, hidden_states, temb=None, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", "The `scale` argument is ignored.")
        output_states = ()
        for resnet in self.resnets:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states = torch.utils.checkpoint.checkpoint(resnet, hidden_states, temb, use_reentrant=False)
            else:
                hidden_states = resnet(hidden_states, temb)
            output_states = output_states + (hidden_states,)
        if self.downsamplers is not None:
            for downsampler in self.downsamplers:
                hidden_states = downsampler(hidden_states)
            output_states = output_states + (hidden_states,)
        return hidden_states, output_states


class UNetMidBlock2D(nn.Module):
    def __init__(self, in_channels, temb_channels, groups, dropout, norm, add_attention=True, heads=1):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock2D(
                in_channels=in_channels,
                out_channels=in_channels,
                temb_channels=temb_channels,
                groups=groups,
                dropout=dropout,
                time_embedding_norm=norm,
            )
            for _ in range(2)
        )
        self.attentions = nn.ModuleList(
            [Attention(in_channels, heads=heads, norm_num_groups=groups) if add_attention else None]
        )

    def forward(self, hidden_states, temb=None):
        hidden_states = self.resnets[0](hidden_states, temb)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            if attn is not None:
                hidden_states = attn(hidden_states, temb=temb)
            hidden_states = resnet(hidden_states, temb)
        return hidden_states


class UpBlock2D(nn.Module):
    def __init__(
        self,
        in_channels,
        prev_output_channel,
        out_channels,
        temb_channels,
        num_layers,
        groups,
        add_upsample,
        dropout,
        norm,
    ):
        super().__init__()
        self.resnets = nn.ModuleList()
        for i in range(num_layers):
            res_skip_channels = in_channels if (i == num_layers - 1) else out_channels
            resnet_in_channels = prev_output_channel if i == 0 else out_channels
            self.resnets.append(
                ResnetBlock2D(
                    in_channels=resnet_in_channels + res_skip_channels,
                    out_channels=out_channels,
                    temb_channels=temb_channels,
                    groups=groups,
                    dropout=dropout,
                    time_embedding_norm=norm,
                )
            )
        self.upsamplers = nn.ModuleList([Upsample2D(out_channels, use_conv=True)]) if add_upsample else None

    def forward(self, hidden_states, res_hidden_states_tuple, temb=None, upsample_size=None, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", "The `scale` argument is ignored.")
        for resnet in self.resnets:
            res_hidden_states = res_hidden_states_tuple[-1]
            res_hidden_states_tuple = res_hidden_states_tuple[:-1]
            hidden_states = torch.cat([hidden_states, res_hidden_states], dim=1)
            hidden_states = resnet(hidden_states, temb)
        if self.upsamplers is not None:
            for upsampler in self.upsamplers:
                hidden_states = upsampler(hidden_states, upsample_size)
        return hidden_states


# ---- the UNet ---------------------------------------------------------------------------------


def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0, max_period=10000):
    assert len(timesteps.shape) == 1, "Timesteps should be a 1d-array"
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half_dim, dtype=torch.float32, device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    if embedding_dim % 2 == 1:
        emb = F.pad(emb, (0, 1, 0, 0))
    return emb


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels, time_embed_dim):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample, condition=None):
        if condition is not None:
            raise NotImplementedError("conditioning is not supported here")
        return self.linear_2(self.act(self.linear_1(sample)))


@dataclass
class UNet2DOutput:
    sample: torch.Tensor


class UNet2DModel(nn.Module):
    """Down blocks of resnets and a downsampler, a mid block with attention, up blocks with an
    upsampler, a time embedding, and ``conv_norm_out`` -> ``conv_act`` at the top. With the
    default ``time_embedding_norm`` every GroupNorm but the attention's feeds a SiLU:
    ``2 * layers * levels + 2 * (layers + 1) * levels + 4 + 1`` pairs."""

    def __init__(
        self,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64, 128),
        layers_per_block=2,
        norm_num_groups=32,
        dropout=0.0,
        resnet_time_scale_shift="default",
        attention_head_dim=None,
    ):
        super().__init__()
        self.in_channels = in_channels
        time_embed_dim = block_out_channels[0] * 4
        self.conv_in = nn.Conv2d(in_channels, block_out_channels[0], kernel_size=3, padding=(1, 1))
        self.time_proj_dim = block_out_channels[0]
        self.time_embedding = TimestepEmbedding(block_out_channels[0], time_embed_dim)

        self.down_blocks = nn.ModuleList()
        output_channel = block_out_channels[0]
        for i, channels in enumerate(block_out_channels):
            input_channel, output_channel = output_channel, channels
            is_final_block = i == len(block_out_channels) - 1
            self.down_blocks.append(
                DownBlock2D(
                    input_channel,
                    output_channel,
                    time_embed_dim,
                    layers_per_block,
                    norm_num_groups,
                    not is_final_block,
                    dropout,
                    resnet_time_scale_shift,
                )
            )
        heads = block_out_channels[-1] // attention_head_dim if attention_head_dim else 1
        self.mid_block = UNetMidBlock2D(
            block_out_channels[-1], time_embed_dim, norm_num_groups, dropout, resnet_time_scale_shift, heads=heads
        )

        self.up_blocks = nn.ModuleList()
        self.num_upsamplers = 0
        reversed_block_out_channels = list(reversed(block_out_channels))
        output_channel = reversed_block_out_channels[0]
        for i, channels in enumerate(reversed_block_out_channels):
            prev_output_channel, output_channel = output_channel, channels
            input_channel = reversed_block_out_channels[min(i + 1, len(block_out_channels) - 1)]
            is_final_block = i == len(block_out_channels) - 1
            if not is_final_block:
                self.num_upsamplers += 1
            self.up_blocks.append(
                UpBlock2D(
                    input_channel,
                    prev_output_channel,
                    output_channel,
                    time_embed_dim,
                    layers_per_block + 1,
                    norm_num_groups,
                    not is_final_block,
                    dropout,
                    resnet_time_scale_shift,
                )
            )

        self.conv_norm_out = nn.GroupNorm(num_channels=block_out_channels[0], num_groups=norm_num_groups, eps=1e-5)
        self.conv_act = nn.SiLU()
        self.conv_out = nn.Conv2d(block_out_channels[0], out_channels, kernel_size=3, padding=1)

    def forward(self, sample, timestep, class_labels=None, return_dict=True):
        # The input's size must be a multiple of the overall upsampling factor, or the upsamplers
        # are told the sizes to restore (a check on the input's shape: not symbolically traceable).
        default_overall_up_factor = 2**self.num_upsamplers
        forward_upsample_size = False
        upsample_size = None
        if any(s % default_overall_up_factor != 0 for s in sample.shape[-2:]):
            forward_upsample_size = True
        if class_labels is not None:
            raise ValueError("class_labels are not supported by this model")

        # 1. time
        timesteps = timestep
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
        elif torch.is_tensor(timesteps) and len(timesteps.shape) == 0:
            timesteps = timesteps[None].to(sample.device)
        timesteps = timesteps * torch.ones(sample.shape[0], dtype=timesteps.dtype, device=timesteps.device)
        t_emb = get_timestep_embedding(timesteps, self.time_proj_dim).to(dtype=sample.dtype)
        emb = self.time_embedding(t_emb)

        # 2. pre-process
        skip_sample = sample
        sample = self.conv_in(sample)

        # 3. down
        down_block_res_samples = (sample,)
        for downsample_block in self.down_blocks:
            sample, res_samples = downsample_block(hidden_states=sample, temb=emb)
            down_block_res_samples += res_samples

        # 4. mid
        sample = self.mid_block(sample, emb)

        # 5. up
        for i, upsample_block in enumerate(self.up_blocks):
            is_final_block = i == len(self.up_blocks) - 1
            res_samples = down_block_res_samples[-len(upsample_block.resnets) :]
            down_block_res_samples = down_block_res_samples[: -len(upsample_block.resnets)]
            if not is_final_block and forward_upsample_size:
                upsample_size = down_block_res_samples[-1].shape[2:]
            sample = upsample_block(sample, res_samples, emb, upsample_size)

        # 6. post-process
        sample = self.conv_norm_out(sample)
        sample = self.conv_act(sample)
        sample = self.conv_out(sample)
        del skip_sample

        if not return_dict:
            return (sample,)
        return UNet2DOutput(sample=sample)


# ---- a segmentation decoder -------------------------------------------------------------------


class ConvModule(nn.Module):
    """conv / norm / activation in a configurable ``order``, with per-call switches."""

    def __init__(self, in_channels, out_channels, kernel_size, padding=0, groups=8, act="silu", order=None):
        super().__init__()
        self.order = order or ("conv", "norm", "act")
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=False)
        self.with_norm = groups is not None
        norm_channels = out_channels if self.order.index("norm") > self.order.index("conv") else in_channels
        self.gn = nn.GroupNorm(groups, norm_channels) if self.with_norm else None
        self.with_activation = act is not None
        self.activate = {"silu": nn.SiLU, "relu": nn.ReLU}[act]() if act else None

    @property
    def norm(self):
        return self.gn

    def forward(self, x, activate=True, norm=True):
        for layer in self.order:
            if layer == "conv":
                x = self.conv(x)
            elif layer == "norm" and norm and self.with_norm:
                x = self.norm(x)
            elif layer == "act" and activate and self.with_activation:
                x = self.activate(x)
        return x


class FPNDecoder(nn.Module):
    """Feature-pyramid decoder: lateral 1x1 ConvModules, a top-down path (upsample and add),
    3x3 ConvModules, a fusion ConvModule over the concatenated levels (without its activation:
    its norm output goes into a residual sum), a normalised feature that feeds both the head and
    a skip connection, and a classifier. One lateral uses ReLU. So three GroupNorms are not
    pairs; the rest are conv -> GroupNorm -> SiLU."""

    def __init__(self, in_channels=(16, 32, 64), channels=32, num_classes=5, groups=8):
        super().__init__()
        self.lateral_convs = nn.ModuleList(
            ConvModule(c, channels, 1, groups=groups, act="relu" if i == 0 else "silu")
            for i, c in enumerate(in_channels)
        )
        self.fpn_convs = nn.ModuleList(ConvModule(channels, channels, 3, padding=1, groups=groups) for _ in in_channels)
        self.fusion = ConvModule(len(in_channels) * channels, channels, 3, padding=1, groups=groups)
        self.feature_norm = nn.GroupNorm(groups, channels)
        self.head = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.SiLU()
        )
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)
        self.align_corners = False

    def forward(self, inputs, return_features=False):
        assert len(inputs) == len(self.lateral_convs)
        laterals = [lateral_conv(inputs[i]) for i, lateral_conv in enumerate(self.lateral_convs)]
        for i in range(len(laterals) - 1, 0, -1):
            prev_shape = laterals[i - 1].shape[2:]
            laterals[i - 1] = laterals[i - 1] + F.interpolate(
                laterals[i], size=prev_shape, mode="bilinear", align_corners=self.align_corners
            )
        outs = [self.fpn_convs[i](laterals[i]) for i in range(len(laterals))]
        for i in range(len(outs) - 1, 0, -1):
            outs[i] = F.interpolate(outs[i], size=outs[0].shape[2:], mode="bilinear", align_corners=self.align_corners)
        fused = self.fusion(torch.cat(outs, dim=1), activate=False)
        feature = self.feature_norm(fused + outs[0])
        output = self.conv_seg(self.head(F.silu(feature)) + feature)
        if return_features:
            return output, feature
        return output


class Backbone(nn.Module):
    """Three stages of conv -> GroupNorm -> SiLU at strides 1, 2, 4 (the features FPNDecoder reads)."""

    def __init__(self, in_channels=3, channels=(16, 32, 64), groups=8):
        super().__init__()
        self.stages = nn.ModuleList()
        previous = in_channels
        for i, c in enumerate(channels):
            self.stages.append(
                nn.ModuleDict(
                    dict(
                        conv=nn.Conv2d(previous, c, 3, stride=1 if i == 0 else 2, padding=1),
                        norm=nn.GroupNorm(groups, c),
                    )
                )
            )
            previous = c

    def forward(self, x):
        features = []
        for stage in self.stages:
            x = F.silu(stage["norm"](stage["conv"](x)))
            features.append(x)
        return features


class Segmenter(nn.Module):
    def __init__(self, num_classes=5):
        super().__init__()
        self.backbone = Backbone()
        self.decode_head = FPNDecoder(num_classes=num_classes)

    def forward(self, img, return_features=False):
        return self.decode_head(self.backbone(img), return_features=return_features)


def unet_inputs(batch, size, channels=3, seed=0, dtype=torch.float32):
    """``(sample, timestep)`` for :class:`UNet2DModel`."""
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, channels, size, size, generator=generator, dtype=dtype)
    timestep = torch.randint(0, 1000, (batch,), generator=generator)
    return sample, timestep


def unet_loss(model, sample, timestep, target):
    """The denoising loss of one training step (what T8 times with its backward)."""
    return F.mse_loss(model(sample, timestep).sample, target)


def count_pairs(block_out_channels=(32, 64, 128), layers_per_block=2):
    """The GroupNorm -> SiLU pairs of a default :class:`UNet2DModel` (all but the attention's
    GroupNorm), and its GroupNorms."""
    levels = len(block_out_channels)
    pairs = 2 * layers_per_block * levels + 2 * (layers_per_block + 1) * levels + 2 * 2 + 1
    return pairs, pairs + 1


#: T8's configuration: batch 8, 32x32, 3 levels.
T8_CONFIG = dict(block_out_channels=(32, 64, 128), layers_per_block=2, norm_num_groups=32)


def t8_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return UNet2DModel(**{**T8_CONFIG, **overrides})
