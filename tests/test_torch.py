"""fastbwd.torch (docs/semantics.md §7): routing PyTorch's own backward kernels, GroupNormSwish,
the RoIAlign drop-in. Everything here skips cleanly without torch."""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fastbwd  # noqa: E402
import fastbwd.torch as ft  # noqa: E402
from fastbwd.api import replication_pad2d as replication_pad2d_api  # noqa: E402
from fastbwd.api import upsample_bilinear2d as upsample_api  # noqa: E402
from fastbwd.testing import reference as ref  # noqa: E402
from fastbwd.testing.checks import assert_matches_reference, bitwise_equal  # noqa: E402
from fastbwd.torch import _compile, _convert, _routing, _switch  # noqa: E402

from conftest import run_program  # noqa: E402

A = torch.ops.aten
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FORMATS = [torch.contiguous_format, torch.channels_last]
#: Tolerance against PyTorch's own kernel per dtype (different summation orders).
TORCH_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _bridge_off():
    ft.disable()
    yield
    ft.disable()


def _randn(shape, dtype, seed, memory_format=torch.contiguous_format):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).contiguous(memory_format=memory_format)
    )


def _arrays(*tensors):
    return [_convert.as_array(t) for t in tensors]


def _assert_close_to_torch(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.numel() == 0:
        return
    tol = TORCH_TOL[actual.dtype]
    actual, expected = actual.detach(), expected.detach()  # values only: no autograd graph to keep
    scale = max(float(expected.double().abs().max()), 1e-30)
    error = float((actual.double() - expected.double()).abs().max())
    assert error <= tol * scale, f"max error {error:.3g} (scale {scale:.3g}, {actual.dtype})"


def _same_layout(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.stride() == expected.stride(), f"strides {actual.stride()} != PyTorch's {expected.stride()}"


# ---- routed operators: one case table ---------------------------------------------------------


def _upsample_case(dtype, memory_format, align_corners=False, scales=(None, None), sizes=((2, 3, 5, 7), (9, 12))):
    input_size, output_size = sizes
    grad = _randn((input_size[0], input_size[1], *output_size), dtype, 1, memory_format)
    aten_args = (grad, list(output_size), list(input_size), align_corners, *scales)
    direct = lambda: fastbwd.upsample_bilinear2d_backward(  # noqa: E731
        _convert.as_array(grad), output_size, input_size, align_corners, *scales
    )
    return A.upsample_bilinear2d_backward, aten_args, direct


def _avg_pool_case(
    dtype,
    memory_format,
    kernel=(3, 2),
    stride=(2, 1),
    padding=(1, 0),
    ceil_mode=True,
    count_include_pad=False,
    divisor_override=None,
):
    x = _randn((2, 3, 9, 8), dtype, 2, memory_format)
    out_shape = A.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override).shape
    grad = _randn(tuple(out_shape), dtype, 3, memory_format)
    aten_args = (grad, x, list(kernel), list(stride), list(padding), ceil_mode, count_include_pad, divisor_override)
    direct = lambda: fastbwd.avg_pool2d_backward(  # noqa: E731
        *_arrays(grad, x), kernel, stride, padding, ceil_mode, count_include_pad, divisor_override or 0
    )
    return A.avg_pool2d_backward, aten_args, direct


def _pad_case(dtype, memory_format, padding=(2, 1, 0, 3), shape=(2, 3, 6, 5)):
    x = _randn(shape, dtype, 4, memory_format)
    left, right, top, bottom = padding
    grad = _randn((*shape[:-2], shape[-2] + top + bottom, shape[-1] + left + right), dtype, 5, memory_format)
    direct = lambda: fastbwd.replication_pad2d_backward(*_arrays(grad, x), padding)  # noqa: E731
    return A.replication_pad2d_backward, (grad, x, list(padding)), direct


CASES = {
    "upsample": _upsample_case,
    "upsample-aligned": lambda d, m: _upsample_case(d, m, align_corners=True),
    "upsample-scales": lambda d, m: _upsample_case(d, m, scales=(1.7, 2.5)),
    "upsample-same-height": lambda d, m: _upsample_case(d, m, sizes=((2, 3, 9, 7), (9, 12))),
    "avg_pool": _avg_pool_case,
    "avg_pool-count-pad-divisor": lambda d, m: _avg_pool_case(d, m, count_include_pad=True, divisor_override=5),
    "avg_pool-global": lambda d, m: _avg_pool_case(d, m, kernel=(9, 8), stride=(9, 8), padding=(0, 0), ceil_mode=False),
    "pad": _pad_case,
    "pad-crop": lambda d, m: _pad_case(d, m, padding=(-1, 2, 1, -2)),
}


@pytest.mark.covering
@pytest.mark.parametrize("memory_format", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_routed_result_is_fastbwd_in_pytorch_layout(case, dtype, memory_format):
    """Enabled: bitwise the direct fastbwd call, in PyTorch's dtype and memory format, close to
    PyTorch's own kernel; disabled again: PyTorch's own bits."""
    op, aten_args, direct = CASES[case](dtype, memory_format)
    before = op(*aten_args)
    with ft.enabled():
        served = _routing.SERVED.copy()
        routed = op(*aten_args)
        assert _routing.SERVED - served, "the call was not served by fastbwd"
    after = op(*aten_args)
    _same_layout(routed, before)
    assert bitwise_equal(_convert.as_array(routed), direct())
    _assert_close_to_torch(routed, before)
    assert bitwise_equal(_convert.as_array(before), _convert.as_array(after))


@pytest.mark.parametrize("case", ["upsample", "avg_pool", "pad"])
def test_mixed_memory_formats_follow_pytorchs_rule(case):
    """grad_output contiguous but the forward input channels_last (and the reverse), as a loss
    like ``out.sum()`` gives: the result's layout is PyTorch's (upsampling follows grad_output,
    pooling and padding the forward input), values bitwise the direct call's."""
    for grad_format, input_format in [
        (torch.contiguous_format, torch.channels_last),
        (torch.channels_last, torch.contiguous_format),
    ]:
        op, aten_args, direct = CASES[case](torch.float32, input_format)
        aten_args = (aten_args[0].contiguous(memory_format=grad_format),) + aten_args[1:]
        expected = op(*aten_args)
        with ft.enabled():
            routed = op(*aten_args)
        _same_layout(routed, expected)
        assert bitwise_equal(_convert.as_array(routed), direct())
        _assert_close_to_torch(routed, expected)


@pytest.mark.parametrize("layout", ["same", "empty", "channels_last", "wrong-shape"])
@pytest.mark.parametrize("case", ["upsample", "avg_pool", "pad"])
def test_grad_input_overload(case, layout):
    op, aten_args, direct = CASES[case](torch.float32, torch.contiguous_format)
    expected = op(*aten_args)
    grad_input = {
        "same": lambda: torch.empty_like(expected),
        "empty": lambda: torch.empty(0),
        "channels_last": lambda: torch.empty_like(expected, memory_format=torch.channels_last),
        "wrong-shape": lambda: torch.empty(3, 4),
    }[layout]()
    reference_out = torch.empty_like(grad_input)
    op.grad_input(*aten_args, grad_input=reference_out)
    with ft.enabled():
        result = op.grad_input(*aten_args, grad_input=grad_input)
    assert result is grad_input
    assert result.shape == expected.shape
    assert bitwise_equal(_convert.as_array(result.contiguous()), direct())
    _assert_close_to_torch(result, reference_out)


def test_grad_input_of_another_dtype_gets_pytorchs_answer():
    op, aten_args, _ = CASES["pad"](torch.float32, torch.contiguous_format)
    with pytest.raises(RuntimeError) as plain:
        op.grad_input(*aten_args, grad_input=torch.empty(0, dtype=torch.float64))
    with ft.enabled():
        fallbacks = _routing.FALLBACK.copy()
        with pytest.raises(RuntimeError) as routed:
            op.grad_input(*aten_args, grad_input=torch.empty(0, dtype=torch.float64))
        assert _routing.FALLBACK - fallbacks
    assert str(routed.value) == str(plain.value)


def test_models_train_through_the_bridge_unchanged():
    """nn.Upsample, F.interpolate, nn.AvgPool2d, F.avg_pool2d, nn.ReplicationPad2d, F.pad."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.Upsample(scale_factor=2, mode="bilinear"),
        torch.nn.ReplicationPad2d((1, 2, 0, 1)),
        torch.nn.AvgPool2d(3, 2, 1, count_include_pad=False),
        torch.nn.Conv2d(4, 2, 1),
    ).double()
    x = _randn((2, 3, 10, 7), torch.float64, 6).requires_grad_()

    def gradients():
        model.zero_grad()
        x.grad = None
        y = model(x)
        y = F.interpolate(y, size=(5, 9), mode="bilinear", align_corners=True)
        y = F.avg_pool2d(F.pad(y, (1, 1, 2, 0), mode="replicate"), 2)
        (y * y).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    plain = gradients()
    with ft.enabled():
        served = _routing.SERVED.copy()
        routed = gradients()
        counts = _routing.SERVED - served
    assert set(counts) == set(_routing.ROUTES), counts
    for a, b in zip(routed, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "function",
    [
        lambda x: F.interpolate(x, size=(7, 4), mode="bilinear"),
        lambda x: F.interpolate(x, scale_factor=(1.5, 2.0), mode="bilinear", align_corners=True),
        lambda x: F.avg_pool2d(x, (3, 2), (2, 1), (1, 0), ceil_mode=True, count_include_pad=False),
        lambda x: F.avg_pool2d(x, 2, divisor_override=3),
        lambda x: F.pad(x, (1, 2, 2, 0), mode="replicate"),
    ],
    ids=["upsample", "upsample-scales-aligned", "avg_pool", "avg_pool-divisor", "pad"],
)
def test_gradcheck_and_double_backward_enabled(function):
    x = _randn((2, 3, 5, 4), torch.float64, 7).requires_grad_()
    with ft.enabled():
        assert torch.autograd.gradcheck(function, (x,))
        assert torch.autograd.gradgradcheck(function, (x,))


def test_fallback_to_pytorch_where_fastbwd_refuses():
    """A replicate pad wider than the input (PyTorch allows it, the documents' limit does not):
    PyTorch's own kernel answers, bit for bit; PyTorch's errors stay PyTorch's."""
    x = _randn((1, 2, 3, 2), torch.float32, 8).requires_grad_()
    with pytest.raises(fastbwd.ParamError):
        fastbwd.replication_pad2d_backward(np.ones((1, 2, 3, 8), np.float32), (1, 2, 3, 2), (3, 3, 0, 0))
    F.pad(x, (3, 3, 0, 2), mode="replicate").pow(2).sum().backward()
    expected, x.grad = x.grad, None
    with ft.enabled():
        fallbacks = _routing.FALLBACK.copy()
        F.pad(x, (3, 3, 0, 2), mode="replicate").pow(2).sum().backward()
        assert _routing.FALLBACK - fallbacks
        # PyTorch's own argument errors are unchanged (here: a zero divisor, a wrong grad shape).
        g = torch.ones(1, 2, 1, 1)
        for args in [
            (g, x.detach(), [2, 2], [2, 2], [0, 0], False, True, 0),
            (torch.ones(1, 2, 5, 5), x.detach(), [2, 2], [2, 2], [0, 0], False, True, None),
        ]:
            with ft.enabled():
                with pytest.raises(RuntimeError) as routed_error:
                    A.avg_pool2d_backward(*args)
            ft.disable()
            with pytest.raises(RuntimeError) as plain_error:
                A.avg_pool2d_backward(*args)
            assert str(routed_error.value) == str(plain_error.value)
            ft.enable()
    assert torch.equal(x.grad, expected)


def test_remembered_decisions_serve_and_fall_back_every_time():
    """The bridge decides once per call geometry; every repeat gets the same decision and the
    same bits, and a geometry decided with one grad_input does not decide another's."""
    x = _randn((1, 2, 3, 2), torch.float32, 9)
    narrow = _randn((1, 2, 3, 8), torch.float32, 10)  # pad (3, 3): wider than the input
    wide = _randn((1, 2, 3, 4), torch.float32, 11)  # pad (1, 1): served
    op = A.replication_pad2d_backward
    plain = [op(narrow, x, [3, 3, 0, 0]), op(wide, x, [1, 1, 0, 0])]
    with ft.enabled():
        for _ in range(3):
            served, fallbacks = _routing.SERVED.copy(), _routing.FALLBACK.copy()
            refused = op(narrow, x, [3, 3, 0, 0])
            assert _routing.FALLBACK - fallbacks and not _routing.SERVED - served
            served = _routing.SERVED.copy()
            accepted = op(wide, x, [1, 1, 0, 0])
            assert _routing.SERVED - served
            assert torch.equal(refused, plain[0])
            torch.testing.assert_close(accepted, plain[1], rtol=1e-6, atol=1e-6)
        # the .grad_input overload with the same tensors: a channels_last grad_input is written
        # in place in its own memory format, a float64 one gets PyTorch's error
        out = torch.empty(1, 2, 3, 2).contiguous(memory_format=torch.channels_last)
        for _ in range(2):
            assert op.grad_input(wide, x, [1, 1, 0, 0], grad_input=out) is out
            assert out.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(out, plain[1], rtol=1e-6, atol=1e-6)
            with pytest.raises(RuntimeError):
                op.grad_input(wide, x, [1, 1, 0, 0], grad_input=torch.empty(0, dtype=torch.float64))


def test_remembered_plans_check_overlap_on_every_call():
    """A remembered plan still runs the api's per-call checks: a grad_input with the metadata of
    a served one that overlaps grad_output or the forward input gets PyTorch's kernel (every
    time, whichever came first), and the fresh ones are served again after it."""
    x = _randn((1, 2, 3, 2), torch.float32, 12)
    grad = _randn((1, 2, 3, 4), torch.float32, 13)
    op = A.replication_pad2d_backward.grad_input
    plain = A.replication_pad2d_backward(grad, x, [1, 1, 0, 0])
    direct = fastbwd.replication_pad2d_backward(*_arrays(grad, x), (1, 1, 0, 0))
    for first_overlapping in (True, False):
        replication_pad2d_api.OPERATION.plans.clear()
        with ft.enabled():
            for overlapping in (first_overlapping, not first_overlapping, True, False):
                served, fallbacks = _routing.SERVED.copy(), _routing.FALLBACK.copy()
                if overlapping:
                    # the first 12 elements of grad itself, with a fresh tensor's strides
                    alias = grad.clone().view(-1)[:12].view(1, 2, 3, 2)
                    assert alias.stride() == torch.empty(1, 2, 3, 2).stride()
                    source = alias._base.view(1, 2, 3, 4)
                    op(source, x, [1, 1, 0, 0], grad_input=alias)
                    assert _routing.FALLBACK - fallbacks and not _routing.SERVED - served
                    # the forward input as grad_input: PyTorch's answer (it never reads x)
                    target = x.clone()
                    assert torch.equal(op(grad, target, [1, 1, 0, 0], grad_input=target), plain)
                else:
                    result = op(grad, x, [1, 1, 0, 0], grad_input=torch.empty(1, 2, 3, 2))
                    assert _routing.SERVED - served and not _routing.FALLBACK - fallbacks
                    assert bitwise_equal(_convert.as_array(result), direct)


def test_dispatcher_hands_kernels_schema_types(monkeypatch):
    """PyTorch's dispatcher converts every argument to its schema type before a Python kernel sees
    it: 1 for a bool arrives as True, a tuple or torch.Size for an int[] as a list of int, 2 for a
    float as 2.0. So differently spelled calls of one geometry plan with the same argument types
    and share one plan of the api (whose key tells types apart) and one result."""
    grad = _randn((1, 2, 6, 8), torch.float32, 14)
    spellings = [
        ([6, 8], [1, 2, 3, 4], True, 2.0, 2.0),
        ((6, 8), torch.Size([1, 2, 3, 4]), 1, 2, np.float64(2.0)),
        ([np.int64(6), 8], (1, 2, 3, 4), np.bool_(True), 2.0, 2),
    ]
    seen = []
    original = upsample_api.plan

    def recording(grad_output, *args):
        seen.append([(type(a), [type(v) for v in a] if isinstance(a, list) else None) for a in args[:5]])
        return original(grad_output, *args)

    monkeypatch.setattr(upsample_api, "plan", recording)
    upsample_api.OPERATION.plans.clear()
    results = []
    with ft.enabled():
        for spelling in spellings:
            results.append(A.upsample_bilinear2d_backward(grad, *spelling))
    assert seen == [[(list, [int, int]), (list, [int] * 4), (bool, None), (float, None), (float, None)]] * 3
    assert len(upsample_api.OPERATION.plans) == 1
    for result in results[1:]:
        assert torch.equal(result, results[0])


def test_other_devices_and_lazy_conjugates():
    """Only the CPU key is overridden (a meta tensor still gets PyTorch's meta kernel); a
    conjugate-bit complex gradient is resolved by PyTorch before the CPU kernel sees it."""
    x = torch.randn(1, 1, 3, 3, dtype=torch.complex64)
    g = torch.randn(1, 1, 5, 5, dtype=torch.complex64).conj()
    expected = A.replication_pad2d_backward(g, x, [1, 1, 1, 1])
    with ft.enabled():
        routed = A.replication_pad2d_backward(g, x, [1, 1, 1, 1])
        meta = A.upsample_bilinear2d_backward(torch.empty(1, 1, 4, 4, device="meta"), [4, 4], [1, 1, 2, 2], False)
    torch.testing.assert_close(routed, expected)
    assert meta.device.type == "meta" and meta.shape == (1, 1, 2, 2)


def test_enable_disable_idempotent_and_thread_safe():
    assert not ft.is_enabled()
    ft.enable()
    ft.enable()
    assert ft.is_enabled()
    with ft.enabled():
        assert ft.is_enabled()
    assert ft.is_enabled()  # an enabled() block inside an enabled region leaves it enabled
    ft.disable()
    ft.disable()
    assert not ft.is_enabled()
    errors = []

    def toggle(seed):
        try:
            for i in range(20):
                (ft.enable if (i + seed) % 2 else ft.disable)()
                op, args, _ = CASES["pad"](torch.float32, torch.contiguous_format)
                op(*args)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=toggle, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ft.disable()
    op, args, _ = CASES["upsample"](torch.float32, torch.contiguous_format)
    served = _routing.SERVED.copy()
    op(*args)
    assert _routing.SERVED == served  # disabled: nothing reaches fastbwd


# ---- the switch: one per process, blocks counted (issue 55) --------------------------------------


def _served_backward(seed=90):
    """Whether the backward of a bilinear upsample, run now on this thread (autograd's engine
    runs it), was served by fastbwd (else PyTorch's own kernel answered)."""
    x = _randn((1, 2, 4, 5), torch.float32, seed).requires_grad_()
    before = _routing.SERVED["upsample_bilinear2d_backward"]
    F.interpolate(x, scale_factor=2, mode="bilinear").sum().backward()
    return _routing.SERVED["upsample_bilinear2d_backward"] > before


def _run_in_threads(*steps, names=("A", "B")):
    """Run ``steps`` in lockstep in two threads: step ``i`` of every thread runs after step
    ``i - 1`` of both ended (a barrier between steps, none waits on time). Each step is
    ``step(name, stack)``, ``stack`` the thread's ExitStack for its blocks; errors re-raised."""
    barrier, errors = threading.Barrier(len(names), timeout=300), []

    def run(name):
        try:
            with contextlib.ExitStack() as stack:
                for step in steps:
                    step(name, stack)
                    barrier.wait()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("ends_first", ["A", "B"], ids=["first-entered-ends-first", "last-entered-ends-first"])
def test_enabled_blocks_nest_across_threads(ends_first):
    """Two threads, each in its own ``with enabled():`` block, the blocks overlapping: whichever
    block ends first, fastbwd stays on for the other until it ends (a backward run there is
    fastbwd's), and both threads see the one process-wide switch; after both ended it is off
    (PyTorch's kernels again, the compiler hooks out)."""
    other = "B" if ends_first == "A" else "A"
    seen = {}

    def enter(first):
        return lambda name, stack: name == first and stack.enter_context(ft.enabled())

    def first_ends(name, stack):
        if name == ends_first:
            stack.close()

    def look(when):
        def step(name, stack):
            seen[name, when] = ft.is_enabled()
            if name == other or when == "both ended":  # one thread at a time runs a backward
                seen[name, when, "served"] = _served_backward()
                seen[name, when, "hooks"] = _compile.is_installed()

        return step

    def other_ends(name, stack):
        if name == other:
            stack.close()

    _run_in_threads(enter("A"), enter("B"), look("both running"), first_ends, look("one running"), other_ends)
    look("both ended")("A", None)
    assert seen == {
        ("A", "both running"): True,
        ("B", "both running"): True,
        (other, "both running", "served"): True,
        (other, "both running", "hooks"): True,
        ("A", "one running"): True,  # one switch for the process: the thread whose block ended sees it on
        ("B", "one running"): True,
        (other, "one running", "served"): True,  # the block still running is fastbwd's
        (other, "one running", "hooks"): True,
        ("A", "both ended"): False,
        ("A", "both ended", "served"): False,
        ("A", "both ended", "hooks"): False,
    }


def test_enable_and_disable_beside_running_blocks():
    """enable() turns fastbwd on until disable(); disable() ends that, never a block still running
    (in this thread or another): fastbwd stays on until the last block ends. enable() inside a
    block outlasts the block."""
    with ft.enabled():
        ft.disable()
        assert ft.is_enabled() and _served_backward()  # the block still runs
    assert not ft.is_enabled() and not _served_backward()
    with ft.enabled():
        ft.enable()
    assert ft.is_enabled() and _served_backward()  # enable() lasts until disable()
    with ft.enabled():
        pass
    assert ft.is_enabled()  # a block ending does not end enable()
    ft.disable()
    assert not ft.is_enabled() and not _served_backward()

    seen = {}

    def block(name, stack):
        if name == "B":
            stack.enter_context(ft.enabled())

    def switch(name, stack):
        if name == "A":  # while B's block runs: on, then off again
            ft.enable()
            ft.disable()

    def look(name, stack):
        seen[name] = ft.is_enabled()
        if name == "B":
            seen["served"] = _served_backward()

    _run_in_threads(block, switch, look)
    assert seen == {"A": True, "B": True, "served": True}  # A's disable() did not end B's block
    assert not ft.is_enabled()


@pytest.mark.slow  # a process of its own; a forked child's allocations quick: tests/test_result_cache.py
def test_a_forked_child_counts_only_the_forking_threads_blocks(tmp_path):
    """In a child forked while another thread's block runs (that thread does not exist there)
    fastbwd is off, and its own blocks and enable()/disable() work as in any process."""
    program = textwrap.dedent(
        """
        import os, threading
        import torch
        import fastbwd.torch as ft

        inside, leave = threading.Event(), threading.Event()

        def block():
            with ft.enabled():
                inside.set()
                leave.wait()

        thread = threading.Thread(target=block)
        thread.start()
        inside.wait()
        assert ft.is_enabled()
        pid = os.fork()
        if pid == 0:
            views = [ft.is_enabled()]
            with ft.enabled():
                views.append(ft.is_enabled())
            views.append(ft.is_enabled())
            ft.enable()
            views.append(ft.is_enabled())
            ft.disable()
            views.append(ft.is_enabled())
            os._exit(0 if views == [False, True, False, True, False] else 1)
        _, status = os.waitpid(pid, 0)
        assert ft.is_enabled()  # the parent's thread is still in its block
        leave.set()
        thread.join()
        print(os.waitstatus_to_exitcode(status), ft.is_enabled())
        """
    )
    result = run_program(program, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "False"]


def test_enabled_blocks_nest_in_one_thread():
    """A block inside a block of the same thread: the inner one's end leaves fastbwd on until
    the outer one ends."""
    with ft.enabled():
        with ft.enabled():
            assert ft.is_enabled()
        assert ft.is_enabled() and _served_backward()  # the outer block still runs
    assert not ft.is_enabled() and not _served_backward()


def test_a_block_ended_in_another_thread_ends_itself():
    """A block entered in one thread and ended in another (a generator's, closed there) is its
    own thread's: after it fastbwd is off, and the ending thread's own block is untouched."""

    def steps():
        with ft.enabled():
            yield

    generator = steps()
    next(generator)
    seen = []

    def close_it():
        with ft.enabled():
            generator.close()
            seen.append(ft.is_enabled())
        seen.append(ft.is_enabled())

    thread = threading.Thread(target=close_it)
    thread.start()
    thread.join()
    assert seen == [True, False] and not ft.is_enabled() and not _served_backward()


def test_a_block_starting_while_another_ends(monkeypatch):
    """A block starting in one thread while another thread's block is ending (turning the parts
    off) waits for that end to finish: fastbwd is on inside it, served."""
    ending, entered, ended, seen = threading.Event(), threading.Event(), threading.Event(), {}
    armed = [True]

    def off():  # the last part turned off by the first block's end
        if armed:
            armed.clear()
            ending.set()
            entered.wait(1)  # a block starting now (not held by the switch's lock) enters here

    def other():
        ending.wait(300)
        with ft.enabled():
            entered.set()
            ended.wait(300)
            seen["on"], seen["served"] = ft.is_enabled(), _served_backward()

    monkeypatch.setattr(_switch, "_parts", [*_switch._parts, (lambda: None, off)])
    thread = threading.Thread(target=other)
    with ft.enabled():
        thread.start()
    ended.set()
    thread.join()
    assert seen == {"on": True, "served": True} and not ft.is_enabled()


def test_a_child_forked_inside_a_block_is_inside_it(tmp_path):
    """A child forked inside the forking thread's own block is inside that block: fastbwd on
    there until the block ends in the child (and its nested blocks end)."""
    program = textwrap.dedent(
        """
        import os
        import fastbwd.torch as ft

        with ft.enabled():
            pid = os.fork()
            if pid == 0:
                views = [ft.is_enabled()]
                with ft.enabled():
                    pass
                views.append(ft.is_enabled())
        if pid == 0:
            views.append(ft.is_enabled())
            os._exit(0 if views == [True, True, False] else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), ft.is_enabled())
        """
    )
    result = run_program(program, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "False"]


def _opinfo_samples(name, variant):
    pytest.importorskip("expecttest")
    from torch.testing._internal.common_methods_invocations import op_db

    (opinfo,) = [op for op in op_db if op.name == name and op.variant_test_name == variant]
    return opinfo


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize(
    "name, variant",
    [
        ("nn.functional.interpolate", "bilinear"),
        ("nn.functional.avg_pool2d", ""),
        ("nn.functional.pad", "replicate"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_pytorch_opinfo_samples(name, variant, dtype):
    """PyTorch's own OpInfo sample inputs for these ops: with the bridge enabled every gradient
    is PyTorch's (to the semantics' tolerance), and at least some are served by fastbwd."""
    opinfo = _opinfo_samples(name, variant)
    if dtype not in opinfo.supported_backward_dtypes("cpu"):
        pytest.skip(f"PyTorch does not differentiate {name} in {dtype}")
    served_before = _routing.SERVED.copy()
    checked = 0
    for sample in opinfo.sample_inputs("cpu", dtype, requires_grad=True):

        def gradient(sample=sample):
            for t in [sample.input, *sample.args]:
                if isinstance(t, torch.Tensor):
                    t.grad = None
            out = opinfo(sample.input, *sample.args, **sample.kwargs)
            weights = _randn(out.shape, torch.float64, 9).to(out.dtype)
            (out * weights).sum().backward()
            return sample.input.grad.clone()

        expected = gradient()
        with ft.enabled():
            routed = gradient()
        _assert_close_to_torch(routed, expected)
        checked += 1
    assert checked > 0
    assert _routing.SERVED - served_before, "no sample was served by fastbwd"


def test_import_fastbwd_does_not_import_torch_and_bridge_says_how_to_install():
    code = (
        "import sys, fastbwd; assert 'torch' not in sys.modules\n"
        "sys.modules['torch'] = None\n"
        "try:\n    import fastbwd.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install torch" in result.stdout


@pytest.mark.slow
def test_starting_the_kernels_pool_keeps_torchs_thread_count():
    """Numba's OpenMP pool can share PyTorch's OpenMP runtime, whose thread count its launch
    sets: a program's torch.set_num_threads(1) must survive fastbwd's first call (in a process of
    its own: the pool starts once per process)."""
    code = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from fastbwd.torch import GroupNormSwish\n"
        "x = torch.randn(8, 128, 16, 16, requires_grad=True)\n"
        "GroupNormSwish(32, 128)(x).sum().backward()\n"
        "print(torch.get_num_threads())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, NUMBA_NUM_THREADS="2"),
        timeout=600,
    )
    assert result.stdout.split() == ["1"]


def test_numba_threads_follow_torch():
    import numba

    previous_torch, previous_numba = torch.get_num_threads(), numba.get_num_threads()
    try:
        torch.set_num_threads(1)
        with ft.enabled():
            op, args, _ = CASES["upsample"](torch.float32, torch.contiguous_format)
            op(*args)
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous_torch)
        numba.set_num_threads(previous_numba)


# ---- GroupNormSwish -------------------------------------------------------------------------


def _group_norm_then_swish(x, num_groups, weight, bias, eps=1e-5, swish_scale=1.0):
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return y * torch.sigmoid(swish_scale * y)


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("swish_scale", [1.0, -0.7, 2.5])
@pytest.mark.parametrize("shape, groups", [((2, 6, 5, 7), 3), ((3, 8, 9), 2), ((4, 6), 6)])
def test_group_norm_swish_gradcheck(shape, groups, swish_scale):
    x = _randn(shape, torch.float64, 11).requires_grad_()
    weight = _randn(shape[1:2], torch.float64, 12).requires_grad_()  # both signs
    bias = _randn(shape[1:2], torch.float64, 13).requires_grad_()
    function = lambda x, w, b: ft.group_norm_swish(x, groups, w, b, 1e-5, swish_scale)  # noqa: E731
    assert torch.autograd.gradcheck(function, (x, weight, bias))


@pytest.mark.parametrize("memory_format", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_group_norm_swish_matches_group_norm_then_silu(dtype, memory_format):
    """Forward and every gradient close to nn.GroupNorm + SiLU under PyTorch's autograd, in
    PyTorch's memory format; forward and gradients bitwise equal to direct fastbwd calls (NHWC
    for channels_last input): the forward kernel, then the backward from its mean and rstd."""
    x = _randn((2, 8, 6, 5), dtype, 14, memory_format).requires_grad_()
    weight = _randn((8,), dtype, 15).requires_grad_()
    bias = _randn((8,), dtype, 16).requires_grad_()
    dy = _randn((2, 8, 6, 5), dtype, 17, memory_format)
    expected_y = _group_norm_then_swish(x, 4, weight, bias, 1e-5, 0.8)
    expected = torch.autograd.grad(expected_y, (x, weight, bias), dy)
    y = ft.group_norm_swish(x, 4, weight, bias, 1e-5, 0.8)
    _assert_close_to_torch(y, expected_y)
    _same_layout(y, expected_y)
    actual = torch.autograd.grad(y, (x, weight, bias), dy)
    for a, e in zip(actual, expected):
        _assert_close_to_torch(a, e)
    _same_layout(actual[0], expected[0])
    layout = "NHWC" if memory_format == torch.channels_last else "NCHW"
    nhwc = (lambda t: t.permute(0, 2, 3, 1)) if layout == "NHWC" else (lambda t: t)
    direct_y, mean, rstd = fastbwd.group_norm_swish(
        *_arrays(nhwc(x.detach()), weight, bias), 4, layout, 1e-5, True, 0.8
    )
    assert bitwise_equal(_convert.as_array(nhwc(y.detach()).contiguous()), direct_y)
    direct = fastbwd.group_norm_swish_backward(
        *_arrays(nhwc(dy)), mean, rstd, *_arrays(nhwc(x.detach()), weight, bias), 4, layout, 0.8
    )
    for a, d in zip(actual, direct):
        a = nhwc(a) if a.dim() == 4 else a
        assert bitwise_equal(_convert.as_array(a.contiguous()), d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_group_norm_swish_half_input_with_float32_parameters(dtype):
    x = _randn((2, 8, 7, 6), dtype, 18).requires_grad_()
    weight = _randn((8,), torch.float32, 19).requires_grad_()
    bias = _randn((8,), torch.float32, 20).requires_grad_()
    dy = _randn(x.shape, dtype, 21)
    y = ft.group_norm_swish(x, 2, weight, bias)
    grads = torch.autograd.grad(y, (x, weight, bias), dy)
    assert [g.dtype for g in grads] == [dtype, torch.float32, torch.float32]
    _assert_close_to_torch(y, _group_norm_then_swish(x, 2, weight, bias))
    # The float64 oracle of the same fused backward, from the same (rounded) inputs and the
    # forward kernel's mean and rstd (float32, as the parameters).
    mean, rstd = torch.ops.fastbwd.group_norm_swish(x, weight, bias, 2, 1e-5, 1.0)[1:]
    assert mean.dtype == rstd.dtype == torch.float32
    expected = ref.group_norm_swish_backward(
        *[_convert.as_array(t.detach().double()) for t in (dy, mean, rstd, x, weight, bias)], 2
    )
    assert_matches_reference(_convert.as_array(grads[0]), expected[0])
    for g, e in zip(grads[1:], expected[1:]):
        assert_matches_reference(_convert.as_array(g), e, rtol=1e-4, atol=1e-5)


def test_group_norm_swish_gradients_only_where_required():
    x = _randn((2, 4, 3, 3), torch.float32, 22).requires_grad_()
    module = ft.GroupNormSwish(2, 4)
    module.weight.requires_grad_(False)
    module(x).sum().backward()
    assert x.grad is not None and module.bias.grad is not None and module.weight.grad is None
    plain = ft.GroupNormSwish(2, 4, affine=False)
    x.grad = None
    plain(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(_group_norm_then_swish(x, 2, None, None).sum(), x)[0])
    with torch.no_grad():
        assert not module(x).requires_grad


def test_group_norm_swish_module_loads_a_group_norm_checkpoint():
    norm = torch.nn.GroupNorm(4, 8)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    fused = ft.GroupNormSwish(4, 8, swish_scale=1.0)
    fused.load_state_dict(norm.state_dict())
    assert fused.state_dict().keys() == norm.state_dict().keys()
    x = _randn((2, 8, 5, 5), torch.float32, 23)
    torch.testing.assert_close(fused(x), F.silu(norm(x)), rtol=1e-6, atol=1e-6)
    assert "swish_scale=1.0" in repr(fused)


def test_fuse_group_norm_swish():
    block = lambda channels: torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(channels, 8, 3, padding=1),
        torch.nn.GroupNorm(2, 8),
        torch.nn.SiLU(),
        torch.nn.GroupNorm(4, 8),
        torch.nn.ReLU(),
    )
    model, reference = (
        torch.nn.Sequential(block(4), torch.nn.Sequential(block(8), torch.nn.GroupNorm(2, 8), torch.nn.SiLU())).double()
        for _ in range(2)
    )
    reference.load_state_dict(model.state_dict())
    keys = model.state_dict().keys()
    weights = [p for p in model.parameters()]
    x = _randn((2, 4, 6, 6), torch.float64, 24).requires_grad_()
    assert ft.fuse_group_norm_swish(model, (x,)) == 3
    again = ft.fuse_group_norm_swish(model, (x,))  # nothing new: the same three, already GroupNormSwish
    assert again == 3 and all(f.where.startswith("already a GroupNormSwish") for f in again.fused)
    assert model.state_dict().keys() == keys
    assert [p for p in model.parameters()] == weights  # the same Parameter objects
    assert sum(isinstance(m, ft.GroupNormSwish) for m in model.modules()) == 3
    assert sum(type(m) is torch.nn.GroupNorm for m in model.modules()) == 2  # followed by ReLU
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


# ---- RoIAlign drop-in -----------------------------------------------------------------------


def _roi_boxes(dtype):
    """(K, 5) boxes over two 11 x 13 images: inside, partly outside, tiny, and degenerate."""
    return torch.tensor(
        [
            [0, 1.0, 2.0, 9.5, 7.0],
            [1, -3.0, 4.0, 14.0, 12.5],
            [1, 5.2, 5.1, 5.4, 5.3],
            [0, 8.0, 3.0, 2.0, 1.0],
            [0, 0.0, 0.0, 12.0, 10.0],
        ],
        dtype=dtype,
    )


@pytest.mark.covering
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 0, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roi_align_forward_and_backward(dtype, sampling_ratio, aligned):
    """Forward against the float64 oracle; backward bitwise fastbwd.roi_align_backward."""
    x = _randn((2, 3, 11, 13), dtype, 25).requires_grad_()
    boxes = _roi_boxes(dtype)
    y = ft.roi_align(x, boxes, (3, 4), 0.8, sampling_ratio, aligned)
    assert y.shape == (5, 3, 3, 4) and y.dtype == dtype
    ratio = max(sampling_ratio, 0)
    expected = ref.roi_align_forward(
        _convert.as_array(x.detach().double()), _convert.as_array(boxes.double()), 3, 4, 0.8, ratio, aligned
    )
    assert_matches_reference(_convert.as_array(y.detach()), expected)
    g = _randn(y.shape, dtype, 26)
    (grad,) = torch.autograd.grad(y, x, g)
    direct = fastbwd.roi_align_backward(*_arrays(g, boxes), (2, 3, 11, 13), 3, 4, 0.8, ratio, aligned)
    assert bitwise_equal(_convert.as_array(grad), direct)


@pytest.mark.parametrize("sampling_ratio", [0, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roi_align_channels_last_runs_nhwc_without_copies(dtype, sampling_ratio, monkeypatch):
    """A channels_last feature map: the NHWC kernels both ways, reading the input and a
    channels_last gradient in place; channels_last output and input gradient, bitwise the NCHW
    ones."""
    from fastbwd.api import roi_align as roi_align_api

    x = _randn((2, 37, 11, 13), dtype, 27)
    x_cl = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    x = x.requires_grad_()
    boxes = _roi_boxes(dtype)
    seen = {}
    for name in ("run_forward", "run"):
        function = getattr(roi_align_api, name)

        def spy(plan, source, boxes, out, name=name, function=function):
            seen[name] = source
            return function(plan, source, boxes, out)

        monkeypatch.setattr(roi_align_api, name, spy)
    y = ft.roi_align(x, boxes, (3, 4), 0.8, sampling_ratio, True)
    y_cl = ft.roi_align(x_cl, boxes, (3, 4), 0.8, sampling_ratio, True)
    assert np.shares_memory(seen["run_forward"], _convert.as_array(x_cl.detach()))
    assert y_cl.is_contiguous(memory_format=torch.channels_last) and not y_cl.is_contiguous()
    assert bitwise_equal(_convert.as_array(y_cl.detach()), _convert.as_array(y.detach()))
    g = _randn(y.shape, dtype, 28)
    g_cl = g.contiguous(memory_format=torch.channels_last)
    (grad,) = torch.autograd.grad(y, x, g)
    (grad_cl,) = torch.autograd.grad(y_cl, x_cl, g_cl)
    assert np.shares_memory(seen["run"], _convert.as_array(g_cl))
    assert grad_cl.is_contiguous(memory_format=torch.channels_last) and not grad_cl.is_contiguous()
    assert bitwise_equal(_convert.as_array(grad_cl), _convert.as_array(grad))
    # a contiguous gradient of the channels_last output: still a channels_last input gradient
    y_cl = ft.roi_align(x_cl, boxes, (3, 4), 0.8, sampling_ratio, True)
    (grad_cl,) = torch.autograd.grad(y_cl, x_cl, g)
    assert grad_cl.is_contiguous(memory_format=torch.channels_last)
    assert bitwise_equal(_convert.as_array(grad_cl), _convert.as_array(grad))
    # through the operators (the dispatcher path torch.compile records), double backward too
    y_op = torch.ops.fastbwd.roi_align(x_cl, boxes, 0.8, 3, 4, sampling_ratio, True)
    assert y_op.is_contiguous(memory_format=torch.channels_last)
    (grad_op,) = torch.autograd.grad(y_op, x_cl, g_cl, create_graph=True)
    assert grad_op.is_contiguous(memory_format=torch.channels_last)
    assert bitwise_equal(_convert.as_array(grad_op.detach()), _convert.as_array(grad))


def test_roi_align_gradcheck_boxes_forms_and_module():
    x = _randn((2, 2, 7, 6), torch.float64, 27).requires_grad_()
    boxes = _roi_boxes(torch.float64)[:3]
    for aligned, ratio in [(True, 2), (False, 0)]:
        assert torch.autograd.gradcheck(
            lambda x, ratio=ratio, aligned=aligned: ft.roi_align(x, boxes, 2, 0.5, ratio, aligned), (x,)
        )
    per_image = [boxes[boxes[:, 0] == i, 1:] for i in range(2)]
    rows = torch.cat([boxes[boxes[:, 0] == i] for i in range(2)])
    torch.testing.assert_close(
        ft.roi_align(x, per_image, (2, 3), 0.5, 2), ft.roi_align(x, rows, (2, 3), 0.5, 2), rtol=0, atol=0
    )
    module = ft.RoIAlign((2, 3), 0.5, 2, aligned=True)
    torch.testing.assert_close(module(x, rows), ft.roi_align(x, rows, (2, 3), 0.5, 2, True), rtol=0, atol=0)
    assert "sampling_ratio=2" in repr(module)
    assert ft.roi_align(x, [], 2).shape == (0, 2, 2, 2)
    with torch.no_grad():
        assert not ft.roi_align(x, rows, 2).requires_grad
    with pytest.raises(fastbwd.ParamError, match="Tensor\\[L, 4\\]"):
        ft.roi_align(x, [torch.zeros(2, 5, dtype=torch.float64)], 2)
    with pytest.raises(fastbwd.ParamError, match="Tensor\\[K, 5\\]"):
        ft.roi_align(x, torch.zeros(2, 4, dtype=torch.float64), 2)
    # a pooled size of 0 has nothing to compute: empty results, as torchvision's
    empty = ft.roi_align(x, rows, (2, 0))
    assert empty.shape == (len(rows), 2, 2, 0)
    assert torch.equal(torch.autograd.grad(empty.sum(), x)[0], torch.zeros_like(x))
    # what torchvision's kernels refuse raises its exception type, RuntimeError, naming the call's arguments
    with pytest.raises(RuntimeError, match=r"^roi_align: boxes.dtype must equal input.dtype \(float64\)"):
        ft.roi_align(x, rows.float(), 2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64], ids=str)
def test_roi_align_refuses_other_dtypes_with_torchvisions_exception_type(dtype):
    """An integer, bool or complex feature map: the RuntimeError torchvision raises for the same
    call (its CPU kernel: "not implemented for 'Int'"), saying which dtypes are taken, from every
    entry point: both box forms, boxes float or of the input's dtype, the module, CPU autocast
    (which casts floating-point tensors only, as autocast does), the registered operators, and
    a compiled call (refused when traced, by the fake kernel)."""
    x = torch.ones(2, 3, 11, 13).to(dtype)
    boxes = _roi_boxes(torch.float32)
    per_image = [boxes[boxes[:, 0] == i, 1:] for i in range(2)]
    grad = torch.ones(5, 3, 2, 2).to(dtype)
    message = (
        f"roi_align: (input|grad).dtype must be one of float32, float64, float16, bfloat16, but got {str(dtype)[6:]}"
    )
    calls = [
        lambda: ft.roi_align(x, boxes, 2),
        lambda: ft.roi_align(x, boxes.to(dtype), 2),
        lambda: ft.roi_align(x, per_image, (2, 3), 0.5, 0, True),
        lambda: ft.RoIAlign(2, 1.0, 2)(x, boxes),
        lambda: torch.ops.fastbwd.roi_align(x, boxes, 1.0, 2, 2, 2, False),
        lambda: torch.ops.fastbwd.roi_align_backward(grad, boxes, 1.0, 2, 2, 2, 3, 11, 13, 2, False),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=f"^{message}$"):
            call()
        with pytest.raises(RuntimeError, match=f"^{message}$"), torch.autocast("cpu", dtype=torch.bfloat16):
            call()
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=message):
        torch.compile(ft.roi_align, backend="aot_eager", fullgraph=True)(x, boxes, 2)
    torch._dynamo.reset()


def test_roi_align_matches_pure_pytorch_formulation():
    """An independent check: torchvision's semantics written with torch ops (no fastbwd code)."""
    from bench import roi_baselines

    x = _randn((2, 3, 11, 13), torch.float64, 28).requires_grad_()
    boxes = _roi_boxes(torch.float64)
    for aligned, ratio in [(True, 2), (False, 0), (False, 3)]:
        y = ft.roi_align(x, boxes, (3, 4), 0.8, ratio, aligned)
        expected = roi_baselines.torch_roi_align(x, boxes, 3, 4, 0.8, ratio, aligned)
        torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
        g = _randn(y.shape, torch.float64, 29)
        torch.testing.assert_close(
            torch.autograd.grad(y, x, g)[0], torch.autograd.grad(expected, x, g)[0], rtol=1e-10, atol=1e-12
        )


# ---- what the user's objects do between calls (issue 55) ----------------------------------------


class _NormBlock(torch.nn.Module):
    """conv -> GroupNorm -> SiLU -> conv, the norm and the activation called in forward() as
    diffusion blocks call them; ``fused_module``: a GroupNormSwish instead (its SiLU inside)."""

    def __init__(self, fused_module=False):
        super().__init__()
        nn = torch.nn
        self.conv_in, self.conv_out = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 1)
        self.norm = ft.GroupNormSwish(4, 8) if fused_module else nn.GroupNorm(4, 8)
        self.act = nn.Identity() if fused_module else nn.SiLU()

    def forward(self, x):
        return self.conv_out(self.act(self.norm(self.conv_in(x))))


class _Detector(torch.nn.Module):
    """A detector's second stage: a backbone conv, RoIAlign of its features, a head."""

    def __init__(self, roi_align):
        super().__init__()
        self.backbone, self.head = torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Linear(3 * 2 * 3, 4)
        self.roi_align = roi_align

    def forward(self, x, boxes):
        return self.head(self.roi_align(self.backbone(x), boxes).flatten(1))


class _PlainRoIAlign(torch.nn.Module):
    """torchvision's roi_align written with PyTorch ops (bench/roi_baselines.py)."""

    def forward(self, features, boxes):
        from bench import roi_baselines

        return roi_baselines.torch_roi_align(features, boxes, 2, 3, 0.5, 2, True)


def _requires_grad_models(kind):
    """``(ours, PyTorch's, the parameters to freeze and unfreeze, inputs)`` with equal parameters."""
    torch.manual_seed(5)
    if kind == "roi_align":
        plain = _Detector(_PlainRoIAlign())
        ours = _Detector(ft.RoIAlign((2, 3), 0.5, 2, aligned=True))
        ours.load_state_dict(plain.state_dict())
        boxes = torch.tensor([[0, 1.0, 2.0, 9.5, 7.0], [1, -3.0, 4.0, 14.0, 12.5], [1, 5.2, 5.1, 5.4, 5.3]])
        return ours, plain, ("backbone.weight", "backbone.bias"), (_randn((2, 2, 11, 13), torch.float32, 6), boxes)
    plain = _NormBlock()
    with torch.no_grad():
        plain.norm.weight.uniform_(0.5, 1.5)
        plain.norm.bias.normal_()
    x = _randn((2, 3, 6, 5), torch.float32, 7)
    if kind == "GroupNormSwish":
        ours = _NormBlock(fused_module=True)
        ours.load_state_dict(plain.state_dict())
    else:  # the pair fuse_group_norm_swish fuses in forward()
        import copy

        ours = copy.deepcopy(plain)
        assert ft.fuse_group_norm_swish(ours, (x,)) == 1 and type(ours.norm) is ft.FusedGroupNorm
    return ours, plain, ("norm.weight",), (x,)


@pytest.mark.parametrize("kind", ["GroupNormSwish", "fused pair", "roi_align"])
def test_a_parameter_frozen_then_unfrozen_then_frozen_gets_pytorchs_gradients(kind):
    """A parameter's requires_grad flipped between two training steps of one geometry (fine-tuning
    freezes and unfreezes layers): frozen, unfrozen, frozen again, every gradient of the model is
    plain PyTorch's each time (the frozen parameter's None), as is the output."""
    ours, plain, flipped, inputs = _requires_grad_models(kind)
    target = None
    for frozen in (True, False, True):
        results = []
        for model in (ours, plain):
            for name, parameter in model.named_parameters():
                parameter.grad = None
                parameter.requires_grad_(not (frozen and name in flipped))
            output = model(*inputs)
            target = _randn(output.shape, torch.float32, 8) if target is None else target
            F.mse_loss(output, target).backward()
            results.append((output.detach(), {name: p.grad for name, p in model.named_parameters()}))
        (output, grads), (expected_output, expected_grads) = results
        torch.testing.assert_close(output, expected_output, rtol=1e-4, atol=1e-5)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            assert (grad is None) == (expected_grads[name] is None) == (frozen and name in flipped), (frozen, name)
            if grad is not None:
                torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=(frozen, name))


class _Tracked(torch.Tensor):
    """A tensor subclass as libraries write them (tagged or unit-carrying tensors): every result
    keeps its type (torch.Tensor's own ``__torch_function__``), and it records what it sees."""

    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs)


_TRACKED_CASES = (
    "GroupNormSwish, subclass input",
    "GroupNormSwish, subclass parameters",
    "group_norm_swish, subclass input",
    "roi_align, subclass input",
    "roi_align, subclass input, boxes per image",
    "RoIAlign, subclass boxes",
)


def _tracked_case(case):
    """``(our call, PyTorch's call, the operator the subclass must see, our leaves, PyTorch's
    leaves)``: the same values, some of ours of the subclass."""
    f64 = torch.float64
    x, boxes = _randn((2, 4, 6, 5), f64, 9), _roi_boxes(f64)
    weight, bias = _randn((4,), f64, 10) + 1, _randn((4,), f64, 11)

    def leaf(tensor, subclass=False):
        tensor = tensor.detach().clone()
        return (tensor.as_subclass(_Tracked) if subclass else tensor).requires_grad_()

    def swish(x, weight=None, bias=None, scale=1.0):
        y = F.group_norm(x, 2, weight, bias)
        return y * torch.sigmoid(scale * y)

    subclass_input = "subclass input" in case
    ours_x, plain_x = leaf(x, subclass_input), leaf(x)
    if case.startswith("GroupNormSwish"):
        norm = ft.GroupNormSwish(2, 4, dtype=f64)
        norm.weight = torch.nn.Parameter(leaf(weight, not subclass_input))
        norm.bias = torch.nn.Parameter(leaf(bias, not subclass_input))
        plain_weight, plain_bias = leaf(weight), leaf(bias)
        ours, plain = [ours_x, norm.weight, norm.bias], [plain_x, plain_weight, plain_bias]
        return lambda: norm(ours_x), lambda: swish(plain_x, plain_weight, plain_bias), OPS_GNS, ours, plain
    if case.startswith("group_norm_swish"):
        ours = lambda: ft.group_norm_swish(ours_x, 2, swish_scale=0.7)  # noqa: E731
        return ours, lambda: swish(plain_x, scale=0.7), OPS_GNS, [ours_x], [plain_x]
    if "per image" in case:  # their rows in image order
        boxes = torch.cat([boxes[boxes[:, 0] == i] for i in range(2)])
    ours_boxes = boxes if subclass_input else boxes.as_subclass(_Tracked)
    if "per image" in case:
        ours_boxes = [ours_boxes[ours_boxes[:, 0] == i, 1:] for i in range(2)]
    if case.startswith("RoIAlign"):
        ours = lambda: ft.RoIAlign((2, 3), 0.5, 2, aligned=True)(ours_x, ours_boxes)  # noqa: E731
    else:
        ours = lambda: ft.roi_align(ours_x, ours_boxes, (2, 3), 0.5, 2, True)  # noqa: E731
    return ours, lambda: _PlainRoIAlign()(plain_x, boxes), OPS_ROI, [ours_x], [plain_x]


OPS_GNS, OPS_ROI = torch.ops.fastbwd.group_norm_swish, torch.ops.fastbwd.roi_align


def test_a_models_parameters_take_the_eager_path():
    """A GroupNormSwish's weight and bias are nn.Parameters, plain tensors to the eager shortcut:
    the module's call runs the operator's code without the dispatcher (as a call with plain
    tensors does; a subclass with ``__torch_function__`` does not, as the test below checks)."""
    norm = ft.GroupNormSwish(2, 6)
    x = _randn((2, 6, 5, 4), torch.float32, 13).requires_grad_()
    assert type(norm.weight) is torch.nn.Parameter
    assert type(norm(x).grad_fn).__name__ == "EagerGroupNormSwishBackward"


@pytest.mark.parametrize("case", _TRACKED_CASES)
def test_a_tensor_subclass_keeps_its_type_and_sees_the_operator(case):
    """A tensor subclass with ``__torch_function__`` through GroupNormSwish, group_norm_swish and
    roi_align (as input, parameters or boxes): the result keeps its type, as nn.GroupNorm's and
    torchvision's do, its ``__torch_function__`` sees fastbwd's operator (which it may handle
    itself), and the values and gradients are plain PyTorch's."""
    ours, pytorchs, operator, leaves, plain_leaves = _tracked_case(case)
    _Tracked.seen.clear()
    result = ours()
    assert type(result) is _Tracked
    assert {operator, operator.default} & set(_Tracked.seen), _Tracked.seen
    expected = pytorchs()
    torch.testing.assert_close(result.as_subclass(torch.Tensor), expected, rtol=1e-10, atol=1e-12)
    grad = _randn(expected.shape, torch.float64, 12)
    for got, want in zip(torch.autograd.grad(result, leaves, grad), torch.autograd.grad(expected, plain_leaves, grad)):
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=1e-10, atol=1e-12)
