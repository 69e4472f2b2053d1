"""roi_align benchmarks: the backward on docs/semantics.md §6 R1, R2 and one 1e7-pixel box with adaptive
sampling, with the two baselines of ``bench/roi_baselines.py`` when torch is installed
(the pure-PyTorch formulation, autograd through index_add, and the serial torchvision-style loop);
the forward ``roi_align_forward`` (for fastbwd.torch and fastbwd.jax) on the R1 and R2 shapes
(R1f, R2f; NCHW and channels-last), with the pure-PyTorch forward as its baseline; the NHWC
layout's cases (R1-NHWC, R2-NHWC, R1f-NHWC, R2f-NHWC) beside fastbwd on the same values in NCHW;
O6, a warm call of either direction on a tiny input (torchvision's operators beside it where
installed).

Run: python -m pytest bench/bench_roi_align.py --benchmark-enable --benchmark-only
"""

import numpy as np
import pytest

import fastbwd

from .benchutil import case_id, op_cases, prepared_case, standard_benchmarks
from .cases import OPS, Case, Prepared, fastbwd_calls

bench_fastbwd, bench_fastbwd_out, bench_baseline = standard_benchmarks(
    "roi_align_backward", baselines=["torch (pure PyTorch)", "serial loop"]
)


@pytest.mark.parametrize("baseline", ["fastbwd NCHW", "fastbwd NCHW out="])
@pytest.mark.parametrize(
    "case",
    [
        param
        for name in ("roi_align_backward", "roi_align_forward")
        for param in op_cases(name)
        if param.values[0].params.get("layout") == "NHWC"
    ],
)
def bench_nchw_of_nhwc_case(case, baseline, measure, smoke):
    """fastbwd on an NHWC case's values in NCHW (allocating, and out=): issue 40's targets are
    ratios to it."""
    prepared = prepared_case(case, smoke=smoke)
    measure(case, prepared.baselines[baseline], prepared.nbytes, baseline)


#: One box of about 1e7 feature-map pixels (3163 x 3163 at scale 0.25) around the R1 image:
#: adaptive sampling gives 452 x 452 samples per bin, of which only those in the image are visited.
HUGE = Case(
    "R-huge",
    "roi_align_backward",
    "(2,256,200,304), one 1e7-pixel box, adaptive",
    dict(
        input_shape=(2, 256, 200, 304),
        pooled_height=7,
        pooled_width=7,
        spatial_scale=0.25,
        sampling_ratio=0,
        aligned=True,
        box=(1, -5520.0, -5920.0, 7132.0, 6732.0),
    ),
)


def _prepare_huge(case):
    p = case.params
    boxes = np.array([p["box"]], np.float32)
    grad_output = np.random.default_rng(0).uniform(-1, 1, (1, p["input_shape"][1], 7, 7)).astype(np.float32)
    args = (
        grad_output,
        boxes,
        p["input_shape"],
        p["pooled_height"],
        p["pooled_width"],
        p["spatial_scale"],
        p["sampling_ratio"],
        p["aligned"],
    )
    run, run_out, out = fastbwd_calls(fastbwd.roi_align_backward, *args)
    return Prepared(run=run, run_out=run_out, nbytes=grad_output.nbytes + out.nbytes)


@pytest.mark.parametrize("case", [pytest.param(HUGE, id=case_id(HUGE))])
def bench_fastbwd_huge_box(case, measure, smoke):
    prepared = _prepare_huge(OPS["roi_align_backward"].smoke_case(case) if smoke else case)
    measure(case, prepared.run, prepared.nbytes, "fastbwd")


# ---- the forward (roi_align_forward, behind fastbwd.torch.roi_align and fastbwd.jax.roi_align):
# R1 and R2's shapes, NCHW and channels-last, beside the pure-PyTorch forward (float32 NCHW, fixed sampling)

bench_forward, bench_forward_out, bench_forward_baseline = standard_benchmarks(
    "roi_align_forward", baselines=["torch (pure PyTorch)"]
)


# ---- O6 (issue 39): the per-call cost on a tiny input ------------------------------------------
# A warm direct call with out= on (2, 8, 16, 16) and 4 boxes (2 x 2 bins), where the kernels take
# a microsecond or two: what is left is the call's own cost. torchvision's operators are the
# baseline where torchvision is installed (it is not on the development machine).


def _tiny_roi_calls():
    from fastbwd.api.roi_align import roi_align_forward

    from .inputs import roi_boxes

    shape, params = (2, 8, 16, 16), (2, 2, 0.5, 2, True)
    boxes = roi_boxes(4, shape, 0.5)
    rng = np.random.default_rng(61)
    x, grad = rng.standard_normal(shape).astype(np.float32), rng.standard_normal((4, 8, 2, 2)).astype(np.float32)
    grad_input, pooled = np.empty(shape, np.float32), np.empty((4, 8, 2, 2), np.float32)
    calls = {
        "backward": lambda: fastbwd.roi_align_backward(grad, boxes, shape, *params, out=grad_input),
        "forward": lambda: roi_align_forward(x, boxes, *params, out=pooled),
    }
    baselines = {}
    try:
        import torch
        import torchvision  # noqa: F401

        ops = torch.ops.torchvision
        t_x, t_grad, t_boxes = (torch.from_numpy(a) for a in (x, grad, boxes))
        baselines = {
            "backward": lambda: ops._roi_align_backward(t_grad, t_boxes, 0.5, 2, 2, *shape, 2, True),
            "forward": lambda: ops.roi_align(t_x, t_boxes, 0.5, 2, 2, 2, True),
        }
    except ImportError:
        pass
    return calls, baselines


@pytest.mark.parametrize("variant", ["fastbwd", "torchvision"])
@pytest.mark.parametrize("direction", ["backward", "forward"])
def bench_tiny_call(direction, variant, benchmark):
    calls, baselines = _tiny_roi_calls()
    function = (calls if variant == "fastbwd" else baselines).get(direction)
    if function is None:
        pytest.skip("torchvision is not installed")
    function()  # warm: plan made, kernel compiled
    benchmark.group = f"O6 roi_align {direction}, tiny (2,8,16,16), 4 boxes 2x2"
    benchmark.extra_info.update(case="O6", variant=variant, target="report")
    benchmark.pedantic(function, rounds=200, warmup_rounds=10, iterations=1)
