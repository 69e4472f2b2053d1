"""fastbwd.torch.fuse_group_norm_swish on models written the usual way (docs/semantics.md §7):
blocks that call norm, activation and conv in forward(), as diffusion and segmentation models
do; what must not be fused; what cannot be traced; and the report."""

import copy
import pickle

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fastbwd.torch as ft  # noqa: E402


class ResnetBlock(nn.Module):
    """A diffusion UNet's residual block: norm, activation (a module attribute, and F.silu),
    conv in forward(); an optional time embedding; conditionals on module attributes; dropout
    that depends on the training flag."""

    def __init__(self, in_channels, out_channels, temb_channels=None, groups=4, dropout=0.5):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels) if temb_channels else None
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=1e-6)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nonlinearity = nn.SiLU()
        self.p = dropout
        self.use_shortcut = in_channels != out_channels
        self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1) if self.use_shortcut else None

    def forward(self, input_tensor, temb=None):
        hidden = self.norm1(input_tensor)
        hidden = self.nonlinearity(hidden)
        hidden = self.conv1(hidden)
        if temb is not None and self.time_emb_proj is not None:
            hidden = hidden + self.time_emb_proj(self.nonlinearity(temb))[:, :, None, None]
        hidden = self.norm2(hidden)
        hidden = torch.nn.functional.silu(hidden)
        hidden = F.dropout(hidden, self.p, self.training)
        hidden = self.conv2(hidden)
        if self.use_shortcut:
            input_tensor = self.conv_shortcut(input_tensor)
        return input_tensor + hidden


class SegmentationHead(nn.Module):
    """conv, norm, activation through an attribute holding the function; norms in a ModuleList;
    one GroupNorm whose output is also used elsewhere (must not be fused)."""

    def __init__(self, channels=8):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2))
        self.norms = nn.ModuleList(nn.GroupNorm(2, channels) for _ in range(2))
        self.act = F.silu
        self.shared = nn.GroupNorm(4, channels)

    def forward(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = self.act(norm(conv(x)))
        normed = self.shared(x)
        return F.silu(normed) + 0.5 * normed


class DataDependent(nn.Module):
    """Control flow on tensor values: fx cannot trace it, so it stays as it is."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x):
        if x.sum() > 0:
            return F.silu(self.norm(x))
        return self.norm(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = ResnetBlock(8, 16, temb_channels=6)
        self.block2 = ResnetBlock(16, 16)
        self.head = SegmentationHead(16)
        self.tail = nn.Sequential(nn.GroupNorm(4, 16), nn.SiLU(), nn.Conv2d(16, 8, 1), nn.GroupNorm(2, 8), nn.ReLU())
        self.odd = DataDependent()

    def forward(self, x, temb=None):
        x = self.block2(self.block1(self.stem(x), temb))
        return self.odd(self.tail(self.head(x)))


def models():
    torch.manual_seed(0)
    model = Model().double()
    reference = copy.deepcopy(model)
    return model, reference


def run(model, x, temb, train=True):
    model.train(train)
    torch.manual_seed(1)  # the same dropout masks
    out = model(x, temb)
    out.square().sum().backward()
    return out


def test_fuses_pairs_inside_forward_and_keeps_parameters_and_keys():
    model, reference = models()
    keys = list(model.state_dict())
    parameters = list(model.parameters())
    report = ft.fuse_group_norm_swish(model)
    assert [f.name for f in report.fused] == [
        "block1.norm1",
        "block1.norm2",
        "block2.norm1",
        "block2.norm2",
        "head.norms.0",
        "head.norms.1",
        "tail.0",
    ]
    skipped = dict(report.skipped)
    assert set(skipped) == {"head.shared", "tail.3", "odd.norm"}
    assert "used 2 times" in skipped["head.shared"]
    assert "followed by ReLU" in skipped["tail.3"]
    assert "cannot be traced" in skipped["odd.norm"]
    assert report == 7 and int(report) == report.count == 7 and report
    assert "block1.norm1" in str(report) and "odd.norm" in str(report)
    assert list(model.state_dict()) == keys
    assert list(model.parameters()) == parameters  # the same Parameter objects
    assert type(model.block1) is ResnetBlock and model.block1.use_shortcut  # class and attributes kept
    assert isinstance(model.block1.norm1, ft.GroupNormSwish) and model.block1.norm2.eps == 1e-6
    assert type(model.head.shared) is nn.GroupNorm
    assert ft.fuse_group_norm_swish(model) == 0  # idempotent: the rewritten forwards are left alone


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("with_temb", [True, False])
def test_outputs_and_gradients_equal_the_unfused_model(with_temb, train):
    """Both values of the optional argument and both training modes (dropout differs) take the
    graph traced for them."""
    model, reference = models()
    ft.fuse_group_norm_swish(model)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    temb = torch.randn(2, 6, dtype=torch.float64) if with_temb else None
    for positive in (True, False):  # DataDependent's branches both run
        xs = x if positive else -x - 10
        expected = run(reference, xs, temb, train)
        actual = run(model, xs, temb, train)
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-9, msg=name)
        model.zero_grad()
        reference.zero_grad()


def test_keyword_arguments_deepcopy_state_dict_and_pickling():
    model, reference = models()
    ft.fuse_group_norm_swish(model)
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    temb = torch.randn(2, 6, dtype=torch.float64)
    model.eval()
    reference.eval()
    expected = reference.block1(x, temb)
    torch.testing.assert_close(model.block1(input_tensor=x, temb=temb), expected)
    torch.testing.assert_close(model.block1(x, temb=temb), expected)
    twin = copy.deepcopy(model)
    assert twin.block1.norm1 is not model.block1.norm1
    torch.testing.assert_close(twin.block1(x, temb), expected)
    with torch.no_grad():
        twin.block1.conv1.weight.add_(1.0)  # the copy runs its own modules
    assert not torch.allclose(twin.block1(x, temb), expected)
    fresh = Model().double()
    fresh.load_state_dict(model.state_dict())
    fresh.eval()
    torch.testing.assert_close(fresh.block1(x, temb), expected)
    with pytest.raises(TypeError, match="save and load its state_dict"):
        pickle.dumps(model)


def test_unusual_forwards_are_skipped_with_a_reason():
    class VarArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)

        def forward(self, *inputs):
            return F.silu(self.norm(inputs[0]))

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.alias = self.norm

        def forward(self, x):
            return F.silu(self.norm(x))

    class NotSilu(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.unused = nn.GroupNorm(2, 4)

        def forward(self, x):
            return torch.relu(self.norm(x))

    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            self.last = F.silu(self.norm(x))
            return self.last

    container = nn.ModuleDict(dict(varargs=VarArgs(), shared=Shared(), relu=NotSilu(), caching=Caching()))
    report = ft.fuse_group_norm_swish(container)
    reasons = dict(report.skipped)
    assert report == 0 and not report
    assert "assigns attributes" in reasons["caching.norm"]
    assert container["caching"].calls == 0 and not hasattr(container["caching"], "last")  # restored
    assert "*args" in reasons["varargs.norm"]
    assert "several names" in reasons["shared.norm"]
    assert "relu" in reasons["relu.norm"] and "not a SiLU" in reasons["relu.norm"]
    assert "not called" in reasons["relu.unused"]
