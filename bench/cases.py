"""The benchmark side of the operators' registry, shared by the benchmarks (``bench/bench_*.py``),
the main job (``python3 -m bench``) and the tests: each operator of ``fastbwd/_registry.py``
(its kernel paths and self-check) extended with the docs/semantics.md §6 shapes, how to build
each case's inputs, the PyTorch baselines to compare with, and the minimum bytes each call must
move.

One :class:`OpSpec` per operator in :data:`OPS`; its ``cases`` are the canonical (docs/semantics.md §6) cases,
``quick_cases`` small versions of them for the main job without ``--full``. ``prepare(case)``
builds a :class:`Prepared`: zero-argument callables for the fastbwd call (allocating, and with
``out=`` where useful) and for each PyTorch baseline (only when torch is importable), plus the
byte count. Nothing here imports torch at module import.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np

import fastbwd
from fastbwd._dtypes import BY_NAME
from fastbwd._registry import OPERATORS, Operator

from .inputs import channels_last, group_norm_swish_inputs, roi_boxes

#: The target of RoIAlign's NHWC rows against fastbwd's own NCHW call on the same values: the
#: layout must keep its gain (issue 54 retired issue 40's 3x and 4x, out of reach: docs/benchmarks.md).
LAYOUT_GAIN = ">= 1.3x"


@dataclass(frozen=True)
class Case:
    """One benchmark case: an id of docs/semantics.md §6 (with a suffix for variants), what it
    is (its shapes), its parameters and its targets. Ids ending in ``q`` are the main job's small
    versions of the ``--full`` case of the same id."""

    id: str
    op: str
    label: str
    params: dict
    dtype: str = "float32"
    #: baseline name -> target for the speed-up over it, e.g. ``{"torch": ">= 10x"}`` (the issue
    #: that set it in a comment beside it); set on the full-size cases, whose rows get a verdict
    targets: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """A case ready to run: callables and the minimum bytes read + written per call."""

    run: Callable[[], object]
    nbytes: int
    run_out: Callable[[], object] | None = None
    #: baseline name -> zero-argument callable: PyTorch's own calls (when torch is installed) and,
    #: for a layout whose target is a ratio to another layout, fastbwd's call on the same values
    #: in that layout ("fastbwd NCHW", "fastbwd NCHW out=")
    baselines: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class OpSpec(Operator):
    """An operator of the registry (``fastbwd/_registry.py``) with its benchmark cases."""

    prepare: Callable[[Case, bool], Prepared]  # (case, with_torch) -> Prepared
    cases: tuple
    quick_cases: tuple
    #: a case's params -> the same case at a small size: the benchmark files' smoke run
    #: (``python -m pytest`` without ``--benchmark-enable``) runs every case this size
    smoke: Callable[[dict], dict]

    def smoke_case(self, case):
        """``case`` (same id, dtype, layout and parameters) at the smoke run's size."""
        return replace(case, params=self.smoke(case.params))


def extend(name, **benchmark):
    """The registry's operator ``name`` with the benchmark fields of :class:`OpSpec`."""
    operator = OPERATORS[name]
    return OpSpec(**{f.name: getattr(operator, f.name) for f in fields(Operator)}, **benchmark)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _random(shape, dtype, seed=0, low=-1.0, high=1.0):
    rng = np.random.default_rng(seed)
    values = rng.uniform(low, high, size=shape)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.uniform(low, high, size=shape)
    return values.astype(dtype)


def _to_torch(torch, array):
    """A torch tensor sharing ``array``'s memory (bfloat16 via an int16 view)."""
    if array.dtype == BY_NAME["bfloat16"]:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def fastbwd_calls(function, *args, **kwargs):
    """``(run, run_out, out)`` for a fastbwd function: the allocating call, and the ``out=`` call
    writing into ``out``, the result of one first call made here (which also compiles)."""
    out = function(*args, **kwargs)
    return (lambda: function(*args, **kwargs)), (lambda: function(*args, **kwargs, out=out)), out


def _nbytes(*arrays):
    return int(sum(a.nbytes for a in arrays))


# --------------------------------------------------------------------------------------------
# replication_pad2d_backward (docs/semantics.md §3)
# --------------------------------------------------------------------------------------------


def _prepare_pad(case, with_torch):
    p = case.params
    dtype = BY_NAME[case.dtype]
    input_shape = tuple(p["input_shape"])
    left, right, top, bottom = p["padding"]
    n, c, h, w = input_shape
    grad_output = _random((n, c, h + top + bottom, w + left + right), dtype)
    if p.get("channels_last"):
        grad_output = channels_last(grad_output)
    run, run_out, out = fastbwd_calls(fastbwd.replication_pad2d_backward, grad_output, input_shape, p["padding"])
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(grad_output, out))
    torch = _torch() if with_torch else None
    if torch is not None:
        g = _to_torch(torch, grad_output)
        x = torch.empty(input_shape, dtype=g.dtype)
        if p.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        t_out = torch.empty_like(x)
        pad = list(p["padding"])
        prepared.baselines["torch"] = lambda: torch.ops.aten.replication_pad2d_backward(g, x, pad)
        prepared.baselines["torch out="] = lambda: torch.ops.aten.replication_pad2d_backward.grad_input(
            g, x, pad, grad_input=t_out
        )
    return prepared


_P1 = dict(input_shape=(16, 64, 128, 128), padding=(3, 3, 3, 3))
#: The small shapes (the main job without --full) are chosen so that the kernels, not Python's
#: per-call cost, decide: about a million elements, so a call takes 0.1 ms or more.
_P1_QUICK = dict(input_shape=(4, 32, 64, 64), padding=(3, 3, 3, 3))


def _smoke_pad(p):
    return dict(p, input_shape=(2, 4, 16, 16))


PAD = extend(
    "replication_pad2d_backward",
    prepare=_prepare_pad,
    smoke=_smoke_pad,
    # targets: issue 2 (P1 float32 >= 5x allocating; complex64 and float64 >= 2x), issue 14
    # (P1 float32 out= >= 3x PyTorch's out=)
    cases=(
        Case(
            "P1",
            "replication_pad2d_backward",
            "(16,64,128,128) pad 3",
            _P1,
            targets={"torch": ">= 5x", "torch out=": ">= 3x"},
        ),
        Case("P1", "replication_pad2d_backward", "(16,64,128,128) pad 3", _P1, "complex64", targets={"torch": ">= 2x"}),
        Case("P1", "replication_pad2d_backward", "(16,64,128,128) pad 3", _P1, "float64", targets={"torch": ">= 2x"}),
        Case("P1", "replication_pad2d_backward", "(16,64,128,128) pad 3", _P1, "bfloat16"),
        Case(
            "P1-NHWC",
            "replication_pad2d_backward",
            "(16,64,128,128) pad 3, channels-last",
            dict(_P1, channels_last=True),
        ),
    ),
    quick_cases=(
        Case("P1q", "replication_pad2d_backward", "(4,32,64,64) pad 3", _P1_QUICK),
        Case("P1q", "replication_pad2d_backward", "(4,32,64,64) pad 3", _P1_QUICK, "bfloat16"),
    ),
)


# --------------------------------------------------------------------------------------------
# upsample_bilinear2d_backward (docs/semantics.md §1)
# --------------------------------------------------------------------------------------------


def _prepare_upsample(case, with_torch):
    p = case.params
    dtype = BY_NAME[case.dtype]
    n, c, h, w = p["input_size"]
    oh, ow = p["output_size"]
    align_corners = p["align_corners"]
    layout = p.get("layout", "NCHW")
    grad_nchw = _random((n, c, oh, ow), dtype)
    grad_output = np.ascontiguousarray(grad_nchw.transpose(0, 2, 3, 1)) if layout == "NHWC" else grad_nchw
    args = (grad_output, (oh, ow), (n, c, h, w), align_corners)
    run, run_out, out = fastbwd_calls(fastbwd.upsample_bilinear2d_backward, *args, layout=layout)
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(grad_output, out))
    torch = _torch() if with_torch else None
    if torch is not None:
        g = _to_torch(torch, grad_output)
        if layout == "NHWC":
            g = g.permute(0, 3, 1, 2)  # an NCHW tensor with channels_last strides
        prepared.baselines["torch"] = lambda: torch.ops.aten.upsample_bilinear2d_backward(
            g, [oh, ow], [n, c, h, w], align_corners, None, None
        )
    return prepared


_U1 = dict(input_size=(8, 64, 64, 64), output_size=(128, 128), align_corners=False)
_U1_LABEL = "(8,64,128,128) -> (8,64,64,64)"
_U1_QUICK = dict(input_size=(4, 16, 64, 64), output_size=(128, 128), align_corners=False)
_U1_QUICK_LABEL = "(4,16,128,128) -> (4,16,64,64)"


def _smoke_upsample(p):
    (n, c, h, w), (oh, ow) = p["input_size"], p["output_size"]
    return dict(p, input_size=(min(n, 2), min(c, 4), -(-h // 8), -(-w // 8)), output_size=(-(-oh // 8), -(-ow // 8)))


UPSAMPLE = extend(
    "upsample_bilinear2d_backward",
    prepare=_prepare_upsample,
    smoke=_smoke_upsample,
    cases=(
        # targets: issue 3 (U1 >= 10x, U2 and U4 >= 6x, U5 >= 8x, U3 >= 1.5x PyTorch's channels_last call)
        Case("U1", "upsample_bilinear2d_backward", _U1_LABEL, _U1, targets={"torch": ">= 10x"}),
        Case(
            "U2",
            "upsample_bilinear2d_backward",
            f"{_U1_LABEL}, align_corners",
            dict(_U1, align_corners=True),
            targets={"torch": ">= 6x"},
        ),
        Case(
            "U3",
            "upsample_bilinear2d_backward",
            f"{_U1_LABEL}, NHWC",
            dict(_U1, layout="NHWC"),
            targets={"torch": ">= 1.5x"},
        ),
        Case(
            "U4",
            "upsample_bilinear2d_backward",
            "(4,32,173,173) -> (4,32,100,100)",
            dict(input_size=(4, 32, 100, 100), output_size=(173, 173), align_corners=False),
            targets={"torch": ">= 6x"},
        ),
        Case("U5", "upsample_bilinear2d_backward", _U1_LABEL, _U1, "bfloat16", targets={"torch": ">= 8x"}),
        Case(
            "U6",
            "upsample_bilinear2d_backward",
            "(1,3,1024,1024) -> (1,3,512,512), small N*C",
            dict(input_size=(1, 3, 512, 512), output_size=(1024, 1024), align_corners=False),
        ),
    ),
    quick_cases=(
        Case("U1q", "upsample_bilinear2d_backward", _U1_QUICK_LABEL, _U1_QUICK),
        Case("U3q", "upsample_bilinear2d_backward", f"{_U1_QUICK_LABEL}, NHWC", dict(_U1_QUICK, layout="NHWC")),
        Case("U5q", "upsample_bilinear2d_backward", _U1_QUICK_LABEL, _U1_QUICK, "bfloat16"),
    ),
)


# --------------------------------------------------------------------------------------------
# avg_pool2d_backward (docs/semantics.md §2)
# --------------------------------------------------------------------------------------------


def _prepare_avg_pool(case, with_torch):
    p = case.params
    dtype = BY_NAME[case.dtype]
    input_shape = tuple(p["input_shape"])
    kernel, stride, padding = p["kernel_size"], p["stride"], p["padding"]
    ceil_mode, count_include_pad = p.get("ceil_mode", False), p.get("count_include_pad", True)
    divisor_override = p.get("divisor_override", 0)
    x = np.zeros(input_shape, dtype)
    if p.get("channels_last"):
        x = channels_last(x)
    from fastbwd._validation import pooling_output_size

    oh = pooling_output_size(input_shape[2], kernel[0], stride[0], padding[0], ceil_mode)
    ow = pooling_output_size(input_shape[3], kernel[1], stride[1], padding[1], ceil_mode)
    grad_output = _random((input_shape[0], input_shape[1], oh, ow), dtype)
    if p.get("channels_last"):
        grad_output = channels_last(grad_output)
    args = (grad_output, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    run, run_out, out = fastbwd_calls(fastbwd.avg_pool2d_backward, *args)
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(grad_output, out))
    torch = _torch() if with_torch else None
    if torch is not None:
        g, tx = _to_torch(torch, grad_output), _to_torch(torch, x)
        t_out = torch.empty_like(tx)
        t_args = (
            g,
            tx,
            list(kernel),
            list(stride),
            list(padding),
            ceil_mode,
            count_include_pad,
            divisor_override or None,
        )
        prepared.baselines["torch"] = lambda: torch.ops.aten.avg_pool2d_backward(*t_args)
        prepared.baselines["torch out="] = lambda: torch.ops.aten.avg_pool2d_backward.grad_input(
            *t_args, grad_input=t_out
        )
    return prepared


_A1 = dict(input_shape=(32, 128, 56, 56), kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), count_include_pad=False)
_A1_LABEL = "(32,128,56,56) k3 s2 p1, no pad count"
_A1_QUICK = dict(_A1, input_shape=(4, 64, 56, 56))
_A1_QUICK_LABEL = "(4,64,56,56) k3 s2 p1, no pad count"


def _smoke_avg_pool(p):
    return dict(p, input_shape=(2, 8) + tuple(p["input_shape"][2:]))


AVG_POOL = extend(
    "avg_pool2d_backward",
    prepare=_prepare_avg_pool,
    smoke=_smoke_avg_pool,
    # targets: issue 4 (A1 >= 4x allocating, A2 >= 4x, A3 >= 1x, A1 bfloat16 >= 8x, A1
    # channels-last >= 1x PyTorch's channels_last call), issue 14 (A1 out= >= 6x PyTorch's out=)
    cases=(
        Case("A1", "avg_pool2d_backward", _A1_LABEL, _A1, targets={"torch": ">= 4x", "torch out=": ">= 6x"}),
        Case(
            "A2",
            "avg_pool2d_backward",
            "(32,128,56,56) k2 s2",
            dict(input_shape=(32, 128, 56, 56), kernel_size=(2, 2), stride=(2, 2), padding=(0, 0)),
            targets={"torch": ">= 4x"},
        ),
        Case(
            "A3",
            "avg_pool2d_backward",
            "(32,512,7,7) k7 s1, global",
            dict(input_shape=(32, 512, 7, 7), kernel_size=(7, 7), stride=(1, 1), padding=(0, 0)),
            targets={"torch": ">= 1x"},
        ),
        Case("A1", "avg_pool2d_backward", _A1_LABEL, _A1, "bfloat16", targets={"torch": ">= 8x"}),
        Case(
            "A1-NHWC",
            "avg_pool2d_backward",
            f"{_A1_LABEL}, channels-last",
            dict(_A1, channels_last=True),
            targets={"torch": ">= 1x"},
        ),
    ),
    quick_cases=(
        Case("A1q", "avg_pool2d_backward", _A1_QUICK_LABEL, _A1_QUICK),
        Case("A1q", "avg_pool2d_backward", _A1_QUICK_LABEL, _A1_QUICK, "bfloat16"),
    ),
)


# --------------------------------------------------------------------------------------------
# roi_align_backward (docs/semantics.md §4)
# --------------------------------------------------------------------------------------------


def _prepare_roi_align(case, with_torch):
    p = case.params
    dtype = BY_NAME[case.dtype]
    input_shape = tuple(p["input_shape"])
    k, ph, pw = p["num_boxes"], p["pooled_height"], p["pooled_width"]
    boxes = roi_boxes(k, input_shape, p["spatial_scale"], dtype=dtype)
    grad_output = _random((k, input_shape[1], ph, pw), dtype)
    args = (grad_output, boxes, input_shape, ph, pw, p["spatial_scale"], p["sampling_ratio"], p["aligned"])
    if p.get("layout") == "NHWC":
        # the target is a ratio to the NCHW layout (issue 40): the same values in NCHW, timed in
        # the same alternating rounds
        nchw_run, nchw_run_out, _ = fastbwd_calls(fastbwd.roi_align_backward, *args)
        grad_output = np.ascontiguousarray(grad_output.transpose(0, 2, 3, 1))
        run, run_out, out = fastbwd_calls(fastbwd.roi_align_backward, grad_output, *args[1:], layout="NHWC")
        return Prepared(
            run=run,
            run_out=run_out,
            nbytes=_nbytes(grad_output, boxes, out),
            baselines={"fastbwd NCHW": nchw_run, "fastbwd NCHW out=": nchw_run_out},
        )
    run, run_out, out = fastbwd_calls(fastbwd.roi_align_backward, *args)
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(grad_output, boxes, out))
    torch = _torch() if with_torch else None
    if torch is not None:
        try:
            from . import roi_baselines
        except ImportError:
            roi_baselines = None
        if roi_baselines is not None:
            prepared.baselines.update(roi_baselines.baselines(*args))
    return prepared


_R1 = dict(
    input_shape=(2, 256, 200, 304),
    num_boxes=512,
    pooled_height=7,
    pooled_width=7,
    spatial_scale=0.25,
    sampling_ratio=2,
    aligned=True,
)
_R1_LABEL = "(2,256,200,304), 512 boxes 7x7, sampling 2"
_R1_QUICK = dict(_R1, input_shape=(2, 64, 50, 76), num_boxes=128)
_R1_QUICK_LABEL = "(2,64,50,76), 128 boxes 7x7, sampling 2"


def _smoke_roi_align(p):
    return dict(p, input_shape=(2, 8, 50, 76), num_boxes=16)


ROI_ALIGN = extend(
    "roi_align_backward",
    prepare=_prepare_roi_align,
    smoke=_smoke_roi_align,
    # targets: issue 5 (R1 >= 20x the pure-PyTorch formulation and >= 10x the serial loop, R2 >= 10x the serial
    # loop); NHWC: the layout gain over fastbwd's own NCHW, >= 1.3x, the guard decided in issue 54 (issue 40's
    # 4x and 3x are retired: docs/benchmarks.md says why they were out of reach)
    cases=(
        Case(
            "R1",
            "roi_align_backward",
            _R1_LABEL,
            _R1,
            targets={"torch (pure PyTorch)": ">= 20x", "serial loop": ">= 10x"},
        ),
        Case(
            "R2",
            "roi_align_backward",
            "(2,256,200,304), 512 boxes 7x7, adaptive sampling",
            dict(_R1, sampling_ratio=0),
            targets={"serial loop": ">= 10x"},
        ),
        Case(
            "R1-NHWC",
            "roi_align_backward",
            f"{_R1_LABEL}, NHWC",
            dict(_R1, layout="NHWC"),
            targets={"fastbwd NCHW out=": LAYOUT_GAIN},
        ),
        Case(
            "R2-NHWC",
            "roi_align_backward",
            "(2,256,200,304), 512 boxes 7x7, adaptive sampling, NHWC",
            dict(_R1, sampling_ratio=0, layout="NHWC"),
            targets={"fastbwd NCHW": LAYOUT_GAIN},
        ),
    ),
    quick_cases=(
        Case("R1q", "roi_align_backward", _R1_QUICK_LABEL, _R1_QUICK),
        Case("R1q-NHWC", "roi_align_backward", f"{_R1_QUICK_LABEL}, NHWC", dict(_R1_QUICK, layout="NHWC")),
    ),
)


# --------------------------------------------------------------------------------------------
# roi_align_forward (docs/semantics.md §4, "Forward"; fastbwd.torch.roi_align's and
# fastbwd.jax.roi_align's forward): R1 and R2's shapes, NCHW and channels-last input, against the
# pure-PyTorch gather formulation (float32 NCHW; not for adaptive sampling, whose gathered values
# would take many GB).
# --------------------------------------------------------------------------------------------


def _prepare_roi_align_forward(case, with_torch):
    from fastbwd.api.roi_align import roi_align_forward

    p = case.params
    dtype = BY_NAME[case.dtype]
    input_shape = tuple(p["input_shape"])
    boxes = roi_boxes(p["num_boxes"], input_shape, p["spatial_scale"], dtype=dtype)
    x = _random(input_shape, dtype)
    args = (x, boxes, p["pooled_height"], p["pooled_width"], p["spatial_scale"], p["sampling_ratio"], p["aligned"])
    if p.get("layout") == "NHWC":
        # the target is a ratio to the NCHW layout (issue 40), timed in the same alternating rounds
        nchw_run, nchw_run_out, _ = fastbwd_calls(roi_align_forward, *args)
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
        run, run_out, out = fastbwd_calls(roi_align_forward, x, *args[1:], layout="NHWC")
        return Prepared(
            run=run,
            run_out=run_out,
            nbytes=_nbytes(x, boxes, out),
            baselines={"fastbwd NCHW": nchw_run, "fastbwd NCHW out=": nchw_run_out},
        )
    if p.get("channels_last"):
        x = channels_last(x)
        args = (x,) + args[1:]
    run, run_out, out = fastbwd_calls(roi_align_forward, *args)
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(x, boxes, out))
    torch = _torch() if with_torch else None
    if torch is not None and case.dtype == "float32" and not p.get("channels_last") and p["sampling_ratio"] > 0:
        from .roi_baselines import torch_forward

        prepared.baselines["torch (pure PyTorch)"] = lambda: torch_forward(*args)
    return prepared


ROI_ALIGN_FORWARD = extend(
    "roi_align_forward",
    prepare=_prepare_roi_align_forward,
    smoke=_smoke_roi_align,
    cases=(
        Case("R1f", "roi_align_forward", _R1_LABEL, _R1),
        Case("R1f-CL", "roi_align_forward", f"{_R1_LABEL}, channels-last strides", dict(_R1, channels_last=True)),
        # the NHWC layout's gain over fastbwd's NCHW forward: the guard decided in issue 54 (issue 40's 3x retired)
        Case(
            "R1f-NHWC",
            "roi_align_forward",
            f"{_R1_LABEL}, NHWC",
            dict(_R1, layout="NHWC"),
            targets={"fastbwd NCHW": LAYOUT_GAIN, "fastbwd NCHW out=": LAYOUT_GAIN},
        ),
        Case(
            "R2f", "roi_align_forward", "(2,256,200,304), 512 boxes 7x7, adaptive sampling", dict(_R1, sampling_ratio=0)
        ),
        Case(
            "R2f-NHWC",
            "roi_align_forward",
            "(2,256,200,304), 512 boxes 7x7, adaptive sampling, NHWC",
            dict(_R1, sampling_ratio=0, layout="NHWC"),
        ),
    ),
    quick_cases=(Case("R1fq", "roi_align_forward", _R1_QUICK_LABEL, _R1_QUICK),),
)


# --------------------------------------------------------------------------------------------
# group_norm_swish_backward (docs/semantics.md §5)
# --------------------------------------------------------------------------------------------


def _prepare_group_norm_swish(case, with_torch):
    p = case.params
    dtype = BY_NAME[case.dtype]
    shape, groups, scale = tuple(p["shape"]), p["num_groups"], p.get("swish_scale", 1.0)
    dy, mean, rstd, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype)
    data_format = p.get("data_format", "NCHW")
    nchw_args = (dy, mean, rstd, x, gamma, beta, groups, "NCHW", scale)
    if data_format == "NHWC":
        dy, x = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (dy, x))
    args = (dy, mean, rstd, x, gamma, beta, groups, data_format, scale)
    run, run_out, out = fastbwd_calls(fastbwd.group_norm_swish_backward, *args)
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(dy, x, out[0]))
    if data_format == "NHWC":
        # the target is a ratio to the NCHW layout (issues 14, 53): the same values in NCHW, timed
        # in the same alternating rounds
        nchw_run, nchw_run_out, _ = fastbwd_calls(fastbwd.group_norm_swish_backward, *nchw_args)
        prepared.baselines["fastbwd NCHW"] = nchw_run
        prepared.baselines["fastbwd NCHW out="] = nchw_run_out
    if dtype != np.float32:
        # a half format's target is a ratio to float32's time on the same values (issue 53)
        single = tuple(a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in args)
        single_run, single_run_out, _ = fastbwd_calls(fastbwd.group_norm_swish_backward, *single)
        prepared.baselines["fastbwd float32"] = single_run
        prepared.baselines["fastbwd float32 out="] = single_run_out
    torch = _torch() if with_torch else None
    if torch is not None and data_format == "NCHW":
        tx = _to_torch(torch, x).clone().requires_grad_(True)
        tg = _to_torch(torch, gamma).clone().requires_grad_(True)
        tb = _to_torch(torch, beta).clone().requires_grad_(True)
        tdy = _to_torch(torch, dy)
        y = torch.nn.functional.group_norm(tx, groups, tg, tb, 1e-5)
        swish = torch.nn.functional.silu(y) if scale == 1.0 else y * torch.sigmoid(scale * y)
        prepared.baselines["torch autograd"] = lambda: torch.autograd.grad(swish, (tx, tg, tb), tdy, retain_graph=True)
    return prepared


_G1 = dict(shape=(8, 512, 32, 32), num_groups=32)
_G1_LABEL = "x (8,512,32,32), 32 groups"
_G3_LABEL = "x (2,320,64,64), 32 groups"
_G1_QUICK = dict(shape=(4, 128, 32, 32), num_groups=32)
_G1_QUICK_LABEL = "x (4,128,32,32), 32 groups"


def _smoke_group_norm_swish(p):
    return dict(p, shape=(2, 2 * p["num_groups"], 8, 8))


#: Issue 53's targets for the G1 cases: 75% of the copy yardstick's bandwidth (float32 and
#: channels-last, judged on the out= rows), bfloat16 in at most 0.7 of float32's time (its speed
#: at least 1/0.7 of float32's), channels-last at 0.9 of the NCHW speed or more.
_G1_SHARE = ">= 75% of copy"
_HALF_OF_SINGLE = {"fastbwd float32": ">= 1.43x", "fastbwd float32 out=": ">= 1.43x"}
_NHWC_OF_NCHW = {"fastbwd NCHW": ">= 0.9x", "fastbwd NCHW out=": f">= 0.9x; {_G1_SHARE}"}

GROUP_NORM_SWISH = extend(
    "group_norm_swish_backward",
    prepare=_prepare_group_norm_swish,
    smoke=_smoke_group_norm_swish,
    # targets: issue 6 (G1 >= 2x, G3 >= 1.5x; G1 bfloat16's was withdrawn in issue 14); issue 14's
    # NHWC >= 0.8x of the NCHW speed was retired in issue 54; issue 53's (above) replace it
    cases=(
        Case(
            "G1",
            "group_norm_swish_backward",
            _G1_LABEL,
            _G1,
            targets={"torch autograd": ">= 2x", None: _G1_SHARE},
        ),
        Case(
            "G3",
            "group_norm_swish_backward",
            _G3_LABEL,
            dict(shape=(2, 320, 64, 64), num_groups=32),
            targets={"torch autograd": ">= 1.5x"},
        ),
        Case("G1", "group_norm_swish_backward", _G1_LABEL, _G1, "bfloat16", targets=_HALF_OF_SINGLE),
        Case(
            "G1-NHWC",
            "group_norm_swish_backward",
            f"{_G1_LABEL}, NHWC",
            dict(_G1, data_format="NHWC"),
            targets=_NHWC_OF_NCHW,
        ),
    ),
    quick_cases=(
        Case("G1q", "group_norm_swish_backward", _G1_QUICK_LABEL, _G1_QUICK),
        Case("G1q", "group_norm_swish_backward", _G1_QUICK_LABEL, _G1_QUICK, "bfloat16"),
    ),
)


# --------------------------------------------------------------------------------------------
# group_norm_swish, the forward (docs/semantics.md §5.1)
# --------------------------------------------------------------------------------------------


def _prepare_group_norm_swish_forward(case, with_torch):
    p = case.params
    dtype = BY_NAME[case.dtype]
    shape, groups = tuple(p["shape"]), p["num_groups"]
    _, _, _, x, gamma, beta = group_norm_swish_inputs(shape, groups, dtype)
    data_format = p.get("data_format", "NCHW")
    if data_format == "NHWC":
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    run, run_out, out = fastbwd_calls(fastbwd.group_norm_swish, x, gamma, beta, groups, data_format)
    prepared = Prepared(run=run, run_out=run_out, nbytes=_nbytes(x, out[0]))
    if data_format == "NHWC":  # as the backward's NHWC case: a ratio to NCHW on the same values
        nchw = np.ascontiguousarray(np.moveaxis(x, -1, 1))
        nchw_run, nchw_run_out, _ = fastbwd_calls(fastbwd.group_norm_swish, nchw, gamma, beta, groups)
        prepared.baselines["fastbwd NCHW"] = nchw_run
        prepared.baselines["fastbwd NCHW out="] = nchw_run_out
    if dtype != np.float32:  # as the backward's half cases: a ratio to float32's time
        single = (x.astype(np.float32), gamma.astype(np.float32), beta.astype(np.float32))
        single_run, single_run_out, _ = fastbwd_calls(fastbwd.group_norm_swish, *single, groups, data_format)
        prepared.baselines["fastbwd float32"] = single_run
        prepared.baselines["fastbwd float32 out="] = single_run_out
    torch = _torch() if with_torch else None
    if torch is not None and data_format == "NCHW":
        # what a model runs without fastbwd: nn.GroupNorm then nn.SiLU, no autograd graph
        norm = torch.nn.GroupNorm(groups, shape[1]).to(_to_torch(torch, x).dtype)
        with torch.no_grad():
            norm.weight.copy_(_to_torch(torch, gamma))
            norm.bias.copy_(_to_torch(torch, beta))
        tx = _to_torch(torch, x)

        def torch_forward():
            with torch.no_grad():
                return torch.nn.functional.silu(norm(tx))

        prepared.baselines["torch GroupNorm+SiLU"] = torch_forward
    return prepared


GROUP_NORM_SWISH_FORWARD = extend(
    "group_norm_swish",
    prepare=_prepare_group_norm_swish_forward,
    smoke=_smoke_group_norm_swish,
    # targets: issue 53 (as the backward's G1 cases)
    cases=(
        Case("G1f", "group_norm_swish", _G1_LABEL, _G1, targets={None: _G1_SHARE}),
        Case("G3f", "group_norm_swish", _G3_LABEL, dict(shape=(2, 320, 64, 64), num_groups=32)),
        Case("G1f", "group_norm_swish", _G1_LABEL, _G1, "bfloat16", targets=_HALF_OF_SINGLE),
        Case(
            "G1f-NHWC",
            "group_norm_swish",
            f"{_G1_LABEL}, NHWC",
            dict(_G1, data_format="NHWC"),
            targets=_NHWC_OF_NCHW,
        ),
    ),
    quick_cases=(Case("G1fq", "group_norm_swish", _G1_QUICK_LABEL, _G1_QUICK),),
)


#: Every operator of the registry, in its order (each forward after its backward).
OPS = {
    spec.name: spec
    for spec in (UPSAMPLE, AVG_POOL, PAD, ROI_ALIGN, ROI_ALIGN_FORWARD, GROUP_NORM_SWISH, GROUP_NORM_SWISH_FORWARD)
}
