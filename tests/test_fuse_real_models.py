"""fuse_group_norm_swish on models written the way diffusion and segmentation libraries write
theirs (bench/models/torch_diffusion.py: ``*args, **kwargs``, a deprecation check, one shared nn.SiLU
also used on the time embedding, a branch on a shape, optional up/down-sampling, scale/shift
time embeddings, attention, a top-level forward symbolic tracing cannot run, a decoder of
conv-norm-activation modules; issue 37). Every GroupNorm -> SiLU pair is fused and nothing
else; outputs and gradients equal the unfused model's (bitwise where the same kernels run);
the model saves, loads, deep-copies and prints what runs."""

import copy
import pathlib
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fastbwd.torch as ft  # noqa: E402
from bench.models import torch_diffusion as D  # noqa: E402

#: A small configuration of the UNet (the benchmark's is D.T8_CONFIG).
SMALL = dict(block_out_channels=(8, 16, 32), layers_per_block=2, norm_num_groups=4)


def _unet(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = D.UNet2DModel(**{**SMALL, **overrides}).to(dtype)
    with torch.no_grad():  # GroupNorm parameters away from their 1/0 initial values
        for module in model.modules():
            if isinstance(module, nn.GroupNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def _inputs(batch=2, size=16, dtype=torch.float64, seed=1):
    sample, timestep = D.unet_inputs(batch, size, seed=seed, dtype=dtype)
    return sample, timestep


def _step(model, sample, timestep, seed=2):
    """One training step's output and gradients (parameters by name)."""
    model.zero_grad(set_to_none=True)
    target = torch.randn(sample.shape, generator=torch.Generator().manual_seed(seed), dtype=sample.dtype)
    output = model(sample, timestep).sample
    F.mse_loss(output, target).backward()
    return output.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_steps_close(actual, expected, rtol, atol):
    (out, grads), (out_ref, grads_ref) = actual, expected
    torch.testing.assert_close(out, out_ref, rtol=rtol, atol=atol)
    scale = max(float(g.abs().max()) for g in grads_ref.values())
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=rtol, atol=atol * scale, msg=name)


def _assert_steps_equal(actual, expected):
    (out, grads), (out_ref, grads_ref) = actual, expected
    assert torch.equal(out, out_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_ref[name]), name


def _pair_names(model):
    """Every GroupNorm that feeds a SiLU in the default UNet: the resnets' and conv_norm_out."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.GroupNorm) and (name.split(".")[-1] in ("norm1", "norm2") or name == "conv_norm_out")
    ]


# ---- the UNet ---------------------------------------------------------------------------------


def test_the_unets_top_level_forward_cannot_be_traced_symbolically():
    """The configuration check on the input's shape is what stopped torch.fx-based fusion."""
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(_unet())


def test_unet_every_pair_is_fused_and_nothing_else():
    model = _unet()
    pairs, norms = D.count_pairs(SMALL["block_out_channels"], SMALL["layers_per_block"])
    report = ft.fuse_group_norm_swish(model, _inputs())
    assert [f.name for f in report.fused] == _pair_names(model) and report.count == pairs == 35
    assert report.count + len(report.skipped) == norms
    (attention,) = report.skipped
    assert attention.name == "mid_block.attentions.0.group_norm"
    assert attention.reason == (
        "its output goes to Tensor.transpose in mid_block.attentions.0 (Attention.forward) before any SiLU"
    )
    where = dict(report.fused)
    assert where["down_blocks.0.resnets.0.norm1"] == "nn.SiLU down_blocks.0.resnets.0.nonlinearity"
    assert where["up_blocks.2.resnets.2.norm2"] == "nn.SiLU up_blocks.2.resnets.2.nonlinearity"
    assert where["conv_norm_out"] == "nn.SiLU conv_act"
    assert type(model.mid_block.attentions[0].group_norm) is nn.GroupNorm
    assert all(type(model.get_submodule(name)) is ft.FusedGroupNorm for name in where)


@pytest.mark.slow
def test_unet_decides_alike_without_example_inputs():
    example, live = _unet(), _unet()
    by_example = ft.fuse_group_norm_swish(example, _inputs())
    report = ft.fuse_group_norm_swish(live)
    assert report == 0 and len(report.pending) == 36
    sample, timestep = _inputs()
    first = _step(live, sample, timestep)  # observes: nn.GroupNorm's results
    reference = _step(_unet(), sample, timestep)
    _assert_steps_equal(first, reference)
    second = _step(live, sample, timestep)  # decides, and runs fused
    assert report.fused == by_example.fused and report.skipped == by_example.skipped and report.pending == ()
    _assert_steps_equal(second, _step(example, sample, timestep))  # the same kernels: the same bits


@pytest.mark.slow  # a whole model's steps; the quick set's fused-model values: the resampling blocks
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unet_outputs_and_gradients_equal_the_unfused_model(dtype):
    model, reference = _unet(dtype), _unet(dtype)
    ft.fuse_group_norm_swish(model, _inputs(dtype=dtype))
    sample, timestep = _inputs(dtype=dtype, seed=3)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    for train in (True, False):
        model.train(train)
        reference.train(train)
        _assert_steps_close(_step(model, sample, timestep), _step(reference, sample, timestep), **tolerance)


@pytest.mark.slow
def test_unet_channels_last_and_bfloat16():
    for dtype, memory_format, tolerance in (
        (torch.float32, torch.channels_last, dict(rtol=2e-4, atol=2e-5)),
        (torch.bfloat16, torch.contiguous_format, dict(rtol=0.1, atol=0.05)),
    ):
        model, reference = _unet(dtype), _unet(dtype)
        model.to(memory_format=memory_format)
        reference.to(memory_format=memory_format)
        sample, timestep = _inputs(dtype=dtype)
        sample = sample.contiguous(memory_format=memory_format)
        assert ft.fuse_group_norm_swish(model, (sample, timestep)) == 35
        actual, expected = _step(model, sample, timestep), _step(reference, sample, timestep)
        assert actual[0].stride() == expected[0].stride()
        _assert_steps_close(actual, expected, **tolerance)


@pytest.mark.slow
def test_unet_scale_shift_norms_are_not_pairs():
    model = _unet(resnet_time_scale_shift="scale_shift")
    reference = copy.deepcopy(model)
    report = ft.fuse_group_norm_swish(model, _inputs())
    skipped = dict(report.skipped)
    norm2 = [name for name in _pair_names(model) if name.endswith("norm2")]
    assert set(skipped) == set(norm2) | {"mid_block.attentions.0.group_norm"}
    assert all(skipped[name].startswith("its output goes to Tensor.mul in ") for name in norm2)
    assert report.count == 35 - len(norm2)
    sample, timestep = _inputs(seed=4)
    _assert_steps_close(_step(model, sample, timestep), _step(reference, sample, timestep), 1e-10, 1e-12)


@pytest.mark.slow
def test_unet_state_dict_save_load_deepcopy_and_print(tmp_path):
    model = _unet()
    unfused = copy.deepcopy(model)
    keys = list(model.state_dict())
    ft.fuse_group_norm_swish(model, _inputs())
    assert list(model.state_dict()) == keys
    sample, timestep = _inputs(seed=5)
    expected = _step(model, sample, timestep)
    # the whole fused model, and a deep copy: the same modules, the same bits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for twin in (loaded, copy.deepcopy(model)):
        assert type(twin.conv_norm_out) is ft.FusedGroupNorm and twin.conv_norm_out.fusion_state == "fused"
        _assert_steps_equal(_step(twin, sample, timestep), expected)
    # state dicts both ways: fused into unfused, unfused into fused
    torch.save(model.state_dict(), tmp_path / "state.pt")
    fresh = D.UNet2DModel(**SMALL).double()
    fresh.load_state_dict(torch.load(tmp_path / "state.pt"))
    _assert_steps_close(_step(fresh, sample, timestep), expected, 1e-10, 1e-12)
    other = _unet()
    ft.fuse_group_norm_swish(other, _inputs())
    with torch.no_grad():
        for p in unfused.parameters():
            p.mul_(1.01)
    other.load_state_dict(unfused.state_dict())
    _assert_steps_close(_step(other, sample, timestep), _step(unfused, sample, timestep), 1e-10, 1e-12)
    # print(model) shows what runs
    text = repr(model)
    for name in _pair_names(model):
        assert "fused: runs as fastbwd's GroupNorm+Swish with the SiLU applied to its output" in repr(
            model.get_submodule(name)
        )
    assert "(group_norm): GroupNorm(4, 32, eps=1e-06, affine=True" in text
    assert "(conv_norm_out): FusedGroupNorm(4, 8, eps=1e-05, affine=True" in text
    assert "(conv_act): SiLU()" in text and "(nonlinearity): SiLU()" in text


# ---- blocks -----------------------------------------------------------------------------------


def _resnet(**kwargs):
    torch.manual_seed(0)
    block = D.ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=12, groups=4, **kwargs).double()
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return block


def test_the_deprecation_warning_is_still_raised():
    block = _resnet()
    x, temb = torch.randn(2, 8, 4, 4, dtype=torch.float64), torch.randn(2, 12, dtype=torch.float64)
    with pytest.warns(FutureWarning, match="`scale` is deprecated"):
        report = ft.fuse_group_norm_swish(block, (x, temb), {"scale": 0.5})  # the example forward's own
    assert report == 2
    with pytest.warns(FutureWarning, match="`scale` is deprecated"):
        block(x, temb, scale=1.0)
    with pytest.warns(FutureWarning, match="`scale` is deprecated"):
        block(x, temb, 1.0)  # through *args
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(x, temb)


@pytest.mark.parametrize("resample", ["up", "down"])
def test_resampling_blocks_and_the_branch_on_the_batch_size(resample):
    """``if hidden_states.shape[0] >= 64`` reads the fused norm's output's shape (without
    computing it) and takes the branch at 64."""
    block = _resnet(**{resample: True})
    reference = copy.deepcopy(block)
    temb = torch.randn(64, 12, dtype=torch.float64)
    assert ft.fuse_group_norm_swish(block, (torch.randn(2, 8, 4, 4, dtype=torch.float64), temb[:2])) == 2
    for batch in (2, 64):
        x = torch.randn(batch, 8, 4, 4, dtype=torch.float64, requires_grad=True)
        y, expected = block(x, temb[:batch]), reference(x, temb[:batch])
        torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
        grad, grad_ref = torch.autograd.grad(y.square().sum(), x)[0], torch.autograd.grad(expected.square().sum(), x)[0]
        torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-10)


def test_a_late_second_use_warns_once_and_disarms():
    class Probed(nn.Module):
        """A block with a branch the example forward does not take."""

        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.act = nn.SiLU()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.probe = False

        def forward(self, x):
            h = self.norm(x)
            out = self.conv(self.act(h))
            if self.probe:
                self.statistics = (h.mean(), h.std())
            return out

    torch.manual_seed(0)
    model = Probed()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4, 5, 5)
    assert ft.fuse_group_norm_swish(model, (x,)) == 1
    model.probe = reference.probe = True
    with pytest.warns(UserWarning, match="'norm' was used again after its SiLU") as record:
        y = model(x)
    assert len(record) == 1 and "Probed" not in str(record[0].message)
    expected = reference(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)  # that call's SiLU ran fused
    assert torch.equal(model.statistics[0], reference.statistics[0])  # the other use: nn.GroupNorm's bits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), reference(x))  # not fused any more
    assert model.norm.fusion_state == "skipped"


# ---- the behaviours the mutation audit found unpinned ------------------------------------------


class Cached(nn.Module):
    """Rebinds an attribute that exists already to the norm's output."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)
        self.cache = None

    def forward(self, x):
        self.cache = self.norm(x)
        return F.silu(self.cache)


class Counted(nn.Module):
    """Rebinds an existing counter attribute: harmless, the forward still runs as written."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.silu(self.norm(x))


@pytest.mark.parametrize("example", [True, False])
def test_a_block_that_rebinds_an_attribute(example):
    x = torch.randn(2, 4, 3, 3)
    cached, counted = Cached(), Counted()
    reference = copy.deepcopy(cached)
    reports = [ft.fuse_group_norm_swish(m, (x,) if example else None) for m in (cached, counted)]
    for _ in range(3):
        assert torch.equal(cached(x), reference(x))  # never fused: the output outlives the call
        counted(x)
    (skipped,) = reports[0].skipped
    assert skipped.reason.startswith("its output is still referenced after the call that made it")
    assert reports[1] == 1 and counted.calls == 3 + example  # the example forward is a real forward
    assert torch.equal(cached.cache + 0, reference.cache + 0)


class ScaledSiLU(nn.SiLU):
    """Changes the activation, calling F.silu itself."""

    def forward(self, input):
        return 1.5 * F.silu(input, inplace=self.inplace)


class SharpSiLU(nn.SiLU):
    """Changes the activation without F.silu."""

    def forward(self, input):
        return input * torch.sigmoid(1.7 * input)


@pytest.mark.parametrize("activation", [ScaledSiLU, SharpSiLU])
@pytest.mark.parametrize("example", [True, False])
def test_a_silu_subclass_that_changes_the_activation_is_never_fused(activation, example):
    block = _resnet()
    block.nonlinearity = activation()
    sequential = nn.Sequential(nn.GroupNorm(4, 8), activation()).double()
    reference, sequential_reference = copy.deepcopy(block), copy.deepcopy(sequential)
    x, temb = torch.randn(2, 8, 4, 4, dtype=torch.float64), torch.randn(2, 12, dtype=torch.float64)
    report = ft.fuse_group_norm_swish(block, (x, temb) if example else None)
    assert ft.fuse_group_norm_swish(sequential, (x,) if example else None) == 0
    assert type(sequential[0]) is not ft.GroupNormSwish
    for _ in range(3):
        assert torch.equal(block(x, temb), reference(x, temb))  # nn.GroupNorm's bits: nothing fused
        assert torch.equal(sequential(x), sequential_reference(x))
    assert report == 0 and len(report.skipped) == 2
    if activation is ScaledSiLU:
        assert all("a subclass of nn.SiLU (not fused)" in s.reason for s in report.skipped)


# ---- a segmentation decoder --------------------------------------------------------------------


@pytest.mark.slow
def test_segmentation_decoder():
    torch.manual_seed(0)
    model = D.Segmenter().double()
    reference = copy.deepcopy(model)
    image = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    report = ft.fuse_group_norm_swish(model, (image,))
    assert [f.name for f in report.fused] == [
        "backbone.stages.0.norm",
        "backbone.stages.1.norm",
        "backbone.stages.2.norm",
        "decode_head.lateral_convs.1.gn",
        "decode_head.lateral_convs.2.gn",
        "decode_head.fpn_convs.0.gn",
        "decode_head.fpn_convs.1.gn",
        "decode_head.fpn_convs.2.gn",
        "decode_head.head.1",
    ]
    reasons = dict(report.skipped)
    assert reasons["decode_head.lateral_convs.0.gn"].startswith("its output goes to F.relu in ")
    assert reasons["decode_head.fusion.gn"].startswith("its output goes to Tensor.add in decode_head ")
    assert reasons["decode_head.feature_norm"].startswith("its output is used 2 times (F.silu in decode_head")
    assert dict(report.fused)["backbone.stages.0.norm"] == "F.silu in backbone (Backbone.forward)"
    for return_features in (False, True):
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64, requires_grad=True)
        y, expected = model(x, return_features), reference(x, return_features)
        loss = sum(t.square().sum() for t in (y if return_features else (y,)))
        loss_ref = sum(t.square().sum() for t in (expected if return_features else (expected,)))
        torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=0)
        grads = torch.autograd.grad(loss, [x, *model.parameters()])
        grads_ref = torch.autograd.grad(loss_ref, [x, *reference.parameters()])
        for grad, grad_ref in zip(grads, grads_ref):
            torch.testing.assert_close(grad, grad_ref, rtol=1e-9, atol=1e-11)


# ---- as a program ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_fused_model_trains_saves_and_loads_in_programs_that_exit(tmp_path):
    from test_exit import run_program, warm

    path = tmp_path / "unet.pt"
    root = str(pathlib.Path(__file__).resolve().parents[1])  # where bench/ is
    train = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {root!r})
        import torch, torch.nn.functional as F
        import fastbwd.torch as ft
        from bench.models import torch_diffusion as D

        model = D.UNet2DModel(block_out_channels=(8, 16, 32), norm_num_groups=4)
        report = ft.fuse_group_norm_swish(model)  # decides at the first calls
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sample, timestep = D.unet_inputs(2, 16)
        for step in range(3):
            optimizer.zero_grad()
            F.mse_loss(model(sample, timestep).sample, sample).backward()
            optimizer.step()
        assert report.count == 35 and report.pending == (), report
        torch.save(model, {str(path)!r})
        print("fused", report.count)
        """
    )
    load = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {root!r})
        import torch
        from bench.models import torch_diffusion as D

        model = torch.load({str(path)!r}, weights_only=False)
        fused = sum(type(m).__name__ == "FusedGroupNorm" and m.fusion_state == "fused" for m in model.modules())
        model(*D.unet_inputs(2, 16)).sample.sum().backward()
        print("loaded", fused)
        """
    )
    warm(train)
    assert run_program(train).stdout.split() == ["fused", "35"]
    assert run_program(load).stdout.split() == ["loaded", "35"]
