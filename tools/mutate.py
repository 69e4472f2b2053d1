#!/usr/bin/env python3
"""Mutation check: do the tests catch one-line semantic changes?

Each mutant is an exact-string replacement in one file of the package (a kernel, the api layer
or the oracle) that changes results, paired with the test file that must catch it. For each
mutant this script copies the working tree (tracked and untracked-but-not-ignored files, so
uncommitted edits are included) into a temporary directory, applies the replacement THERE (the
real tree is never written), and runs the test file with ``FASTBWD_CACHE=0``, an Inductor cache
folder of its own (``TORCHINDUCTOR_CACHE_DIR``) and ``-x -q -p no:cacheprovider``. Outcomes:

* killed        the test run failed (the mutant was caught);
* killed (timeout)  the run exceeded ``--timeout``: a hang counts as caught, reported apart;
* survived      the test run passed: the tests do not see the change;
* stale         the snippet is not found exactly once in the file: the list needs refreshing
                (counted as a failure of the mutant list, never as killed).

The score is killed / (killed + survived + stale). Before the mutants, each test file involved
runs once unmutated in a clean copy (``--no-baseline`` skips this): a file that fails there would
"kill" every mutant and prove nothing, so its mutants are reported as "baseline-failed".

Usage::

    python tools/mutate.py --list                 # the mutants
    python tools/mutate.py                        # all of them, one at a time (minutes to an hour)
    python tools/mutate.py --only up- ap-global   # names starting with (or ops equal to) these
    python tools/mutate.py -j 2 --timeout 900 --results mutants.jsonl

Not run in CI. Run it before resolving any issue that touches a kernel (docs/testing.md).
"""

import argparse
import collections
import concurrent.futures
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Mutant = collections.namedtuple("Mutant", "name op file original replacement test description")


def _with_contract(test_file, contract_ids):
    """An operator's own test file and its rows of the contract matrix (tests/test_contract.py,
    selected by the operator's name in their ids): pytest's arguments, split with shlex."""
    module = os.path.basename(test_file)[: -len(".py")]
    return f"{test_file} tests/test_contract.py -k '{module} or {contract_ids}'"


T_UP = _with_contract("tests/test_upsample_bilinear2d.py", "upsample_bilinear2d_backward")
T_AP = _with_contract("tests/test_avg_pool2d.py", "avg_pool2d_backward")
T_PAD = _with_contract("tests/test_replication_pad2d.py", "replication_pad2d_backward")
T_ROI = _with_contract("tests/test_roi_align.py", "roi_align_backward or roi_align_forward")
T_GN = _with_contract("tests/test_group_norm_swish.py", "group_norm_swish_backward")
T_REF = "tests/test_reference.py"
T_HALF = "tests/test_halfbits.py"
T_TORCH = "tests/test_torch.py"
T_PLANS = "tests/test_plans.py"
T_SIMD = "tests/test_simd.py"
T_EXIT = "tests/test_exit.py"
T_GNF = _with_contract("tests/test_group_norm_swish_forward.py", "(group_norm_swish and not group_norm_swish_backward)")
T_FUSE = "tests/test_fuse.py"
T_COMPILE = "tests/test_compile.py"

K_UP = "fastbwd/kernels/upsample_bilinear2d.py"
K_SEP = "fastbwd/kernels/_separable.py"
K_LANES = "fastbwd/kernels/_lanes.py"
K_LANE_TILES = "fastbwd/kernels/_lane_tiles.py"
K_LANE_ROWS = "fastbwd/kernels/_lane_rows.py"
K_MEM = "fastbwd/kernels/_memory.py"
K_AP = "fastbwd/kernels/avg_pool2d.py"
K_PAD = "fastbwd/kernels/replication_pad2d.py"
K_IDX = "fastbwd/kernels/_index.py"
K_HALF = "fastbwd/kernels/_halfbits.py"
K_ROI = "fastbwd/kernels/roi_align.py"
K_GN = "fastbwd/kernels/group_norm_swish.py"
K_GN_MATH = "fastbwd/kernels/_group_norm_math.py"
K_GN_BWD = "fastbwd/kernels/_group_norm_backward.py"
K_GN_FWD = "fastbwd/kernels/_group_norm_forward.py"
A_UP = "fastbwd/api/upsample_bilinear2d.py"
A_AP = "fastbwd/api/avg_pool2d.py"
A_PAD = "fastbwd/api/replication_pad2d.py"
A_ROI = "fastbwd/api/roi_align.py"
A_GN = "fastbwd/api/group_norm_swish.py"
V = "fastbwd/_validation.py"
PLANS = "fastbwd/api/_plans.py"
DT = "fastbwd/_dtypes.py"
B_ROUTING = "fastbwd/torch/_routing.py"
B_GN = "fastbwd/torch/_group_norm_swish.py"
B_OPS = "fastbwd/torch/_ops.py"
B_ROI = "fastbwd/torch/_roi_align.py"
T_TORCH_OPS = "tests/test_torch_ops.py"
B_FUSE = "fastbwd/torch/_fuse.py"
B_COMPILE = "fastbwd/torch/_compile.py"
REF = "fastbwd/testing/reference.py"
J_GATE = "fastbwd/jax/_gate.py"
RC = "fastbwd/_result_cache.py"
CONV = "fastbwd/torch/_convert.py"
T_CACHE = "tests/test_result_cache.py"

MUTANTS = [
    # ---- upsample_bilinear2d: index/lambda tables (kernels) ------------------------------------
    Mutant(
        "up-negative-scale-set",
        "upsample",
        K_UP,
        "    if scale > 0:\n        return opmath.type(1.0 / scale)",
        "    if scale != 0:\n        return opmath.type(1.0 / scale)",
        T_UP,
        "a negative scales_h/scales_w is used as a scale instead of meaning unset (issue 16)",
    ),
    Mutant(
        "up-nan-scale-set",
        "upsample",
        K_UP,
        "    if scale > 0:\n        return opmath.type(1.0 / scale)",
        "    if not scale <= 0:\n        return opmath.type(1.0 / scale)",
        T_UP,
        "a NaN scale is used (NaN steps) instead of meaning unset",
    ),
    Mutant(
        "up-no-half-pixel",
        "upsample",
        K_UP,
        "    source = scale * (output_index + opmath(0.5)) - opmath(0.5)",
        "    source = scale * output_index",
        T_UP,
        "half-pixel centres dropped when align_corners is False",
    ),
    Mutant(
        "up-no-negative-clamp",
        "upsample",
        K_UP,
        "    return np.where(source < 0, opmath(0), source)",
        "    return np.where(source < -1, opmath(0), source)",
        T_UP,
        "negative source positions in (-1, 0) not clamped to 0",
    ),
    Mutant(
        "up-align-corners-ratio",
        "upsample",
        K_UP,
        "            return opmath.type(input_size - 1) / opmath.type(output_size - 1)",
        "            return opmath.type(input_size) / opmath.type(output_size)",
        T_UP,
        "align_corners uses the in/out ratio",
    ),
    Mutant(
        "up-no-identity-shortcut",
        "upsample",
        K_UP,
        "    if output_size == input_size:",
        "    if False:",
        T_UP,
        "PyTorch's identity rule for equal sizes ignored (a user scale then applies)",
    ),
    Mutant(
        "up-index1-early-edge",
        "upsample",
        K_UP,
        "    index1 = index0 + (index0 < input_size - 1)",
        "    index1 = index0 + (index0 < input_size - 2)",
        T_UP,
        "the second tap stops one row early (its weight lands on index0)",
    ),
    Mutant(
        "up-no-lambda-clamp",
        "upsample",
        K_UP,
        "    lambda1 = np.minimum(np.maximum(real_index - index0.astype(opmath), opmath.type(0)), opmath.type(1))",
        "    lambda1 = real_index - index0.astype(opmath)",
        T_UP,
        "lambda1 not clamped to [0, 1] (positions beyond the last row with a user scale)",
    ),
    Mutant(
        "up-lambda0",
        "upsample",
        K_UP,
        "    lambda0 = opmath.type(1) - lambda1",
        "    lambda0 = opmath.type(1) - lambda1 * opmath.type(0.5)",
        T_UP,
        "wrong first weight",
    ),
    # ---- upsample_bilinear2d: api ----------------------------------------------------------------
    Mutant(
        "up-api-scales-swapped",
        "upsample",
        K_UP,
        "*backward_table(g.height, g.out_height, g.align_corners, g.scales_h, g.compute),",
        "*backward_table(g.height, g.out_height, g.align_corners, g.scales_w, g.compute),",
        T_UP,
        "scales_w used for the H axis",
    ),
    Mutant(
        "up-api-float64-opmath",
        "upsample",
        A_UP,
        "        d.compute_dtype(dtype),\n        d.storage_format(dtype),\n    )\n    plan = None",
        "        np.dtype(np.float64),\n        d.storage_format(dtype),\n    )\n    plan = None",
        T_UP,
        "index/lambda arithmetic in float64 for float32 data (docs/semantics.md §1 says float32)",
    ),
    Mutant(
        "up-api-output-size-zero",
        "upsample",
        A_UP,
        "    for index, size in enumerate((output_height, output_width)):\n        if size <= 0:",
        "    for index, size in enumerate((output_height, output_width)):\n        if size < 0:",
        T_UP,
        "output_size 0 accepted by the size check",
    ),
    Mutant(
        "up-api-channels-last-ignored",
        "upsample",
        A_UP,
        "physical_layout = result_layout = d.NHWC if d.is_channels_last(grad_output) else d.NCHW",
        "physical_layout = result_layout = d.NCHW",
        T_UP,
        "a channels-last NCHW gradient gives a C-contiguous result (memory format lost)",
    ),
    # ---- separable engine (shared by upsample and avg_pool; run with upsample's tests) ---------
    Mutant(
        "sep-nhwc-height-weight",
        "upsample",
        K_SEP,
        "                partial[k] += c * load(row[k], fmt)",
        "                partial[k] += load(row[k], fmt)",
        T_UP,
        "NHWC height pass ignores the tap weights",
    ),
    Mutant(
        "sep-nhwc-few-channels",
        "upsample",
        K_SEP,
        "                        acc += weight_w[j] * columns[source_w[j], k]",
        "                        acc += weight_w[j] * columns[source_w[j], 0]",
        T_UP,
        "NHWC with fewer than 16 channels reads channel 0 only in the width pass",
    ),
    Mutant(
        "sep-block-last-row",
        "upsample",
        K_SEP,
        "            rows = min(LANES, height - row_start)",
        "            rows = min(LANES - 1, height - row_start)",
        T_UP,
        "NCHW row blocks leave their 16th row unwritten",
    ),
    Mutant(
        "sep-planes-width-tap",
        "upsample",
        K_SEP,
        "lanes_axpy(result, h * width + w, 0, partial, h * out_width + ow, 0, weight_w[ow, t])",
        "lanes_axpy(result, h * width + w, 0, partial, h * out_width + ow, 0, weight_w[ow, 0])",
        T_UP,
        "16-planes path uses the first tap's width weight for every tap",
    ),
    Mutant(
        "sep-narrow-staging",
        "upsample",
        K_SEP,
        "            target[k] = load(source_row[k], fmt)",
        "            target[k] = load(source_row[0], fmt)",
        T_UP,
        "narrow rows staged with their first element repeated",
    ),
    # ---- avg_pool2d ----------------------------------------------------------------------------
    Mutant(
        "ap-global-width-coverage",
        "avg_pool",
        K_AP,
        "and stop_h[0] == height and stop_w[0] == width:",
        "and stop_h[0] == height:",
        T_AP,
        "a 1x1 output whose window misses columns taken for global pooling (issue 16)",
    ),
    Mutant(
        "ap-global-height-coverage",
        "avg_pool",
        K_AP,
        "and stop_h[0] == height and stop_w[0] == width:",
        "and stop_w[0] == width:",
        T_AP,
        "a 1x1 output whose window misses rows taken for global pooling",
    ),
    Mutant(
        "ap-global-include-pad-divisor",
        "avg_pool",
        K_AP,
        "            divisor = int(extent_h[0]) * int(extent_w[0])",
        "            divisor = height * width",
        T_AP,
        "global pooling with padding divides by the input size, not the padded window",
    ),
    Mutant(
        "ap-global-no-override",
        "avg_pool",
        K_AP,
        "        if g.divisor_override != 0:\n            divisor = g.divisor_override",
        "        if False:\n            divisor = g.divisor_override",
        T_AP,
        "global pooling ignores divisor_override",
    ),
    Mutant(
        "ap-global-nhwc-multiplies",
        "avg_pool",
        K_AP,
        "            first[c] = store(load(src[c], fmt) / divisor, fmt)",
        "            first[c] = store(load(src[c], fmt) * (1 / divisor), fmt)",
        T_AP,
        "global NHWC kernel multiplies by a rounded reciprocal instead of dividing",
    ),
    Mutant(
        "ap-global-nchw-first-cell",
        "avg_pool",
        K_AP,
        "        for i in range(plane_size):\n            dst[i] = value",
        "        for i in range(1, plane_size):\n            dst[i] = value",
        T_AP,
        "global NCHW kernel leaves each plane's first cell unwritten",
    ),
    Mutant(
        "ap-ceil-overhang-counted",
        "avg_pool",
        K_AP,
        "    stop = np.minimum(start + kernel, size + pad)",
        "    stop = start + kernel",
        T_AP,
        "a ceil-mode window's overhang beyond the padding counted in the divisor",
    ),
    Mutant(
        "ap-exclude-pad-divisor",
        "avg_pool",
        K_AP,
        "        divisors = stop - start",
        "        divisors = extent",
        T_AP,
        "count_include_pad=False still counts the padding",
    ),
    Mutant(
        "ap-override-both-axes",
        "avg_pool",
        K_AP,
        "(g.divisor_override, 1) if g.divisor_override != 0 else (None, None)",
        "(g.divisor_override, g.divisor_override) if g.divisor_override != 0 else (None, None)",
        T_AP,
        "divisor_override applied on both axes (divides by d squared)",
    ),
    Mutant(
        "ap-padding-half-kernel",
        "avg_pool",
        A_AP,
        "        if 2 * pad > k:",
        "        if 2 * pad > k + 1:",
        T_AP,
        "padding just above half the kernel accepted",
    ),
    Mutant(
        "ap-default-stride",
        "avg_pool",
        A_AP,
        "    stride = stride or kernel",
        "    stride = stride or (1, 1)",
        T_AP,
        "stride None means 1 instead of the kernel size",
    ),
    Mutant(
        "ap-1x1-channels-last-input",
        "avg_pool",
        A_AP,
        "    if d.is_channels_last(grad_output) or (\n        out_height == out_width == 1 and input_array is not None and d.is_channels_last(input_array)\n    ):",
        "    if d.is_channels_last(grad_output) or (False):",
        T_AP,
        "a channels-last input no longer decides the layout of a 1x1 grad_output",
    ),
    Mutant(
        "ap-ceil-last-window-rule",
        "avg_pool",
        V,
        "    if ceil_mode and (output_size - 1) * stride >= input_size + pad:",
        "    if ceil_mode and (output_size - 1) * stride > input_size + pad:",
        T_AP,
        "ceil_mode keeps a last window that starts in the right padding",
    ),
    Mutant(
        "ap-rows-dispatch-narrow",
        "avg_pool",
        K_AP,
        "    if g.nhwc or out_width < LANES:",
        "    if g.nhwc or out_width < LANES // 2:",
        T_AP,
        "grad rows narrower than LANES sent to the whole-rows kernel (tiles start before the row)",
    ),
    Mutant(
        "ap-rows-residue-taps",
        "avg_pool",
        K_AP,
        "    residue_taps = np.maximum(0, (kernel_w - 1 - q) // stride_w + 1)",
        "    residue_taps = np.maximum(0, (kernel_w - 1 - q) // stride_w)",
        T_AP,
        "whole-rows kernel: each cell misses the last window covering it",
    ),
    Mutant(
        "ap-rows-residue-base",
        "avg_pool",
        K_AP,
        "    residue_base = lead + (residue + pad_w) // stride_w - (kernel_w - 1 - q) // stride_w",
        "    residue_base = lead + (residue + pad_w) // stride_w - (kernel_w - 1 - q) // stride_w + 1",
        T_AP,
        "whole-rows kernel: each cell's windows shifted by one",
    ),
    Mutant(
        "ap-rows-odd-class",
        "avg_pool",
        K_AP,
        "interleaved = (residue_base[0], residue_taps[0], residue_base[1], residue_taps[1])",
        "interleaved = (residue_base[0], residue_taps[0], residue_base[0], residue_taps[0])",
        T_AP,
        "whole-rows kernel, stride 2: odd columns get the even columns' windows",
    ),
    Mutant(
        "ap-rows-scatter-residue",
        "avg_pool",
        K_AP,
        "flat_block[r * width + stride_w * k + residue] = store(sums[residue, k], fmt)",
        "flat_block[r * width + stride_w * k] = store(sums[residue, k], fmt)",
        T_AP,
        "whole-rows kernel, strides other than 2: every class scattered to residue 0",
    ),
    Mutant(
        "ap-rows-task-sources",
        "avg_pool",
        K_AP,
        "            last_plane * out_height + window_stop[last - last_plane * height],",
        "            last_plane * out_height + window_stop[last - last_plane * height] - 1,",
        T_AP,
        "whole-rows kernels: a task's last grad_output row gets no products (stale scratch)",
    ),
    Mutant(
        "ap-rows-task-sources-plane",
        "avg_pool",
        K_AP,
        "            first_plane * out_height + window_first[first - first_plane * height],",
        "            last_plane * out_height + window_first[first - first_plane * height],",
        T_AP,
        "whole-rows kernels: a task crossing planes starts reading in its last plane",
    ),
    Mutant(
        "ap-rows-weight-phase",
        "avg_pool",
        K_AP,
        "            # the sum of its windows' products), LANES columns at a time\n            source_first, source_stop = task_sources[task, 0], task_sources[task, 1]\n            lanes_scaled_rows(\n                products,\n                source,\n                source_first,\n                source_stop - source_first,\n                out_width,\n                weight_h,\n                source_first % out_height,\n                fmt,\n            )\n            p = first // height\n            lanes_scaled_window_sums(",
        "            # the sum of its windows' products), LANES columns at a time\n            source_first, source_stop = task_sources[task, 0], task_sources[task, 1]\n            lanes_scaled_rows(products, source, source_first, source_stop - source_first, out_width, weight_h, 0, fmt)\n            p = first // height\n            lanes_scaled_window_sums(",
        T_AP,
        "whole-rows kernel: every task's products weighted from window 0's weight on",
    ),
    Mutant(
        "ap-rows-depth",
        "avg_pool",
        K_AP,
        "    depth = max(1, int(np.max(task_sources[:, 1] - task_sources[:, 0])))",
        "    depth = max(1, int(task_sources[0, 1] - task_sources[0, 0]))",
        T_AP,
        "whole-rows kernels: scratch for the first task's rows of products only (a task crossing planes overruns it)",
    ),
    Mutant(
        "ap-rows-piece-source",
        "avg_pool",
        K_AP,
        "copy_out(flat, first * width + copied, flat_block, copied, ready - copied, streaming)",
        "copy_out(flat, first * width + copied, flat_block, 0, ready - copied, streaming)",
        T_AP,
        "whole-rows kernel: every piece copies the block's first rows",
    ),
    Mutant(
        "ap-rows-sums-last-vector",
        "avg_pool",
        K_LANE_ROWS,
        "    height = cgutils.unpack_tuple(builder, firsts.shape, 1)[0]\n    last = builder.sub(width, _I64(LANES))",
        "    height = cgutils.unpack_tuple(builder, firsts.shape, 1)[0]\n    last = builder.sub(width, _I64(LANES + 1))",
        T_AP,
        "height pass: the last grad column of each row is not summed (stale V)",
    ),
    Mutant(
        "ap-rows-products-last-vector",
        "avg_pool",
        K_LANE_ROWS,
        "        last = builder.sub(width, _I64(LANES))\n        chunks = builder.sdiv(builder.add(width, _I64(LANES - 1)), _I64(LANES))\n        period",
        "        last = builder.sub(width, _I64(LANES + 1))\n        chunks = builder.sdiv(builder.add(width, _I64(LANES - 1)), _I64(LANES))\n        period",
        T_AP,
        "height pass: the last grad column's products are never computed (stale scratch)",
    ),
    Mutant(
        "ap-rows-plane-step",
        "avg_pool",
        K_LANE_ROWS,
        "builder.store(builder.select(wrapped, builder.add(builder.load(offset), period), builder.load(offset)), offset)",
        "builder.store(builder.load(offset), offset)",
        T_AP,
        "height pass: a task crossing a plane boundary keeps reading the previous plane's windows",
    ),
    Mutant(
        "ap-rows-window-straight",
        "avg_pool",
        K_LANE_ROWS,
        "                    for i in range(fixed):",
        "                    for i in range(fixed // 2 * 2):",
        T_AP,
        "height pass: straight-line sums of an odd number of windows drop the last one",
    ),
    Mutant(
        "ap-rows-interleaved-key",
        "avg_pool",
        K_LANE_ROWS,
        "builder.add(builder.mul(even_count, _I64(4)), odd_count)",
        "builder.add(builder.mul(odd_count, _I64(4)), even_count)",
        T_AP,
        "stride-2 width pass: the straight-line loop of the swapped count pair runs",
    ),
    Mutant(
        "ap-rows-interleaved-straight",
        "avg_pool",
        K_LANE_ROWS,
        "        for i in range(count):\n            pointer = _vector_pointer(builder, src, _I64(0), builder.add(column, _I64(i)), vector)",
        "        for i in range(count - 1):\n            pointer = _vector_pointer(builder, src, _I64(0), builder.add(column, _I64(i)), vector)",
        T_AP,
        "stride-2 width pass: straight-line sums drop their last shift",
    ),
    Mutant(
        "ap-copy-out-unrolled-source",
        "avg_pool",
        K_MEM,
        "stream_line(destination, first + done + j * per_line, source, source_first + done + j * per_line)",
        "stream_line(destination, first + done + j * per_line, source, source_first + done)",
        T_AP,
        "copy_out's unrolled streamed lines all copy the trip's first source line",
    ),
    Mutant(
        "ap-copy-out-tail",
        "avg_pool",
        K_MEM,
        "    copy_part_line(destination, first + done, source, source_first + done, count - done)",
        "    copy_part_line(destination, first + done, source, source_first + done, count - done - 1)",
        T_AP,
        "copy_out drops the last element of each stretch",
    ),
    Mutant(
        "ap-copy-out-head",
        "avg_pool",
        K_MEM,
        "        copy_part_line(destination, first, source, source_first, done)",
        "        copy_part_line(destination, first, source, source_first, done - 1)",
        T_AP,
        "copy_out leaves the last element before its first streamed line unwritten",
    ),
    Mutant(
        "ap-copy-out-stream-source",
        "avg_pool",
        K_MEM,
        "            stream_line(destination, first + done, source, source_first + done)",
        "            stream_line(destination, first + done, source, done)",
        T_SIMD,
        "copy_out's streamed lines ignore the source offset",
    ),
    Mutant(
        "ap-copy-out-stream-head",
        "avg_pool",
        K_MEM,
        "        done = min(count, (LINE_BYTES - offset) % LINE_BYTES // itemsize)",
        "        done = min(count, (LINE_BYTES - offset) % LINE_BYTES // itemsize // 2)",
        T_AP,
        "copy_out streams from a line that is not aligned (or skips head elements)",
    ),
    # ---- replication_pad2d -----------------------------------------------------------------------
    Mutant(
        "pad-copy-offset",
        "pad",
        K_PAD,
        "        copy_src = row[copy_start + pad_left : copy_stop + pad_left]",
        "        copy_src = row[copy_start + pad_left - 1 : copy_stop + pad_left - 1]",
        T_PAD,
        "interior columns copied from one column to the left",
    ),
    Mutant(
        "pad-first-strip",
        "pad",
        K_PAD,
        "        for j in range(first_stop):",
        "        for j in range(1, first_stop):",
        T_PAD,
        "the left edge cell misses the first column of its strip",
    ),
    Mutant(
        "pad-last-strip",
        "pad",
        K_PAD,
        "        for j in range(last_start, out_width):",
        "        for j in range(last_start, out_width - 1):",
        T_PAD,
        "the right edge cell misses the last column of its strip",
    ),
    Mutant(
        "pad-cropped-left-unwritten",
        "pad",
        K_PAD,
        "        for w in range(1, copy_start):  # cropped away by a negative left pad",
        "        for w in range(2, copy_start):  # cropped away by a negative left pad",
        T_PAD,
        "a cell cropped away by a negative left pad is left unwritten (not zeroed)",
    ),
    Mutant(
        "pad-gather-cell-last-column",
        "pad",
        K_PAD,
        "        for j in range(col_start, col_stop):\n            acc += load(plane[i, j], fmt)",
        "        for j in range(col_start, col_stop - 1):\n            acc += load(plane[i, j], fmt)",
        T_PAD,
        "NCHW corners (several source rows and columns) drop a column of each rectangle",
    ),
    Mutant(
        "pad-edge-rows-last-source",
        "pad",
        K_PAD,
        "    for i in range(row_start, row_stop):\n        row = src[i, copy_start + pad_left : copy_stop + pad_left]",
        "    for i in range(row_start, row_stop - 1):\n        row = src[i, copy_start + pad_left : copy_stop + pad_left]",
        T_PAD,
        "NCHW top/bottom rows: the interior column sums miss their last source row",
    ),
    Mutant(
        "pad-edge-rows-left-edge",
        "pad",
        K_PAD,
        "    for w in range(copy_start):\n",
        "    for w in range(1, copy_start):\n",
        T_PAD,
        "NCHW top/bottom rows: the left corner is left unwritten",
    ),
    Mutant(
        "pad-runs-plane-step",
        "pad",
        K_PAD,
        "read_ahead, fmt)\n        h += 1\n        if h == height:\n            p, h = p + 1, 0",
        "read_ahead, fmt)\n        h += 1\n        if h == height:\n            p, h = p, 0",
        T_PAD,
        "NCHW runs of rows crossing a plane boundary stay on the previous plane",
    ),
    Mutant(
        "pad-stream-interior-count",
        "pad",
        K_PAD,
        "copy_out_reading_ahead(interior, 0, copy_src, 0, copy_stop - copy_start, True, read_ahead)",
        "copy_out_reading_ahead(interior, 0, copy_src, 0, copy_stop - copy_start - 1, True, read_ahead)",
        T_PAD,
        "streamed rows (results of 16 MB and more) leave their last interior cell unwritten",
    ),
    Mutant(
        "pad-stream-source-offset",
        "pad",
        K_PAD,
        "copy_out_reading_ahead(interior, 0, copy_src, 0, copy_stop - copy_start, True, read_ahead)",
        "copy_out_reading_ahead(interior, 0, copy_src, 1, copy_stop - copy_start, True, read_ahead)",
        T_PAD,
        "streamed rows copy their interior from one column to the right",
    ),
    Mutant(
        "pad-part-line-last",
        "pad",
        K_MEM,
        "            last = builder.sub(length, _I64(size))",
        "            last = builder.sub(length, _I64(size + itemsize))",
        T_PAD,
        "copy_part_line's second move ends an element early (the pad's streamed rows' ends)",
    ),
    Mutant(
        "pad-stream-runs-plane-step",
        "pad",
        K_PAD,
        "next_p, next_h = (p, h + 1) if h + 1 < height else (p + 1, 0)",
        "next_p, next_h = (p, h + 1) if h + 1 < height else (p, 0)",
        T_PAD,
        "streamed runs of rows crossing a plane boundary stay on the previous plane",
    ),
    Mutant(
        "pad-stream-line-last-lane",
        "pad",
        K_PAD,
        "                    width - 1 - done,",
        "                    width - 2 - done,",
        T_PAD,
        "a streamed row's right edge cell goes one lane early in its line",
    ),
    Mutant(
        "pad-stream-line-first-lane",
        "pad",
        K_PAD,
        "                    -done,",
        "                    1 - done,",
        T_PAD,
        "a streamed row's left edge cell goes one lane late in its line",
    ),
    Mutant(
        "pad-stream-shared-next-source",
        "pad",
        K_PAD,
        "                        next_row - tail,",
        "                        next_row - tail + 1,",
        T_PAD,
        "the line two streamed rows share takes the second row's cells one column late",
    ),
    Mutant(
        "pad-stream-shared-next-first",
        "pad",
        K_PAD,
        "                        tail - 1,",
        "                        tail,",
        T_PAD,
        "the line two streamed rows share puts the first row's last cell over the second's first",
    ),
    Mutant(
        "pad-stream-shared-next-edge",
        "pad",
        K_PAD,
        "next_first, next_last = _edge_cells(grad_output[next_p, next_start], width, pad_left, fmt)",
        "next_last, next_first = _edge_cells(grad_output[next_p, next_start], width, pad_left, fmt)",
        T_PAD,
        "the line two streamed rows share takes the second row's right edge for its left",
    ),
    Mutant(
        "pad-stream-shared-next-plane",
        "pad",
        K_PAD,
        "next_row = (next_p * out_height + next_start) * out_width + pad_left",
        "next_row = (p * out_height + next_start) * out_width + pad_left",
        T_PAD,
        "the line a plane's last streamed row shares with the next plane's first reads this plane",
    ),
    Mutant(
        "pad-stream-carried-last",
        "pad",
        K_PAD,
        "first_value, last_value = next_first, next_last",
        "first_value, last_value = next_first, next_first",
        T_PAD,
        "a streamed row whose first line went out with the row before takes its left edge for its right",
    ),
    Mutant(
        "pad-stream-tail-last-cell",
        "pad",
        K_PAD,
        "destination[start + width - 1] = last_value",
        "destination[start + width - 2] = last_value",
        T_PAD,
        "a streamed row's plain tail puts its right edge cell one column early",
    ),
    Mutant(
        "pad-stream-head-first-cell",
        "pad",
        K_PAD,
        "                if done > 0:\n                    destination[start] = first_value",
        "                if done > 1:\n                    destination[start] = first_value",
        T_PAD,
        "a streamed row whose first partial line is one cell copies its left edge cell",
    ),
    # (equivalent for the pad, whose lane at the split is always its next row's summed edge cell)
    Mutant(
        "simd-line-split",
        "pad",
        K_MEM,
        'builder.icmp_signed("<", lanes, splat(builder, lanes.type, args[5]))',
        'builder.icmp_signed("<=", lanes, splat(builder, lanes.type, args[5]))',
        T_SIMD,
        "stream_line_with_ends takes one lane too many from the first source run",
    ),
    Mutant(
        "simd-line-ends-order",
        "pad",
        K_MEM,
        "for lane, value in ((args[6], args[7]), (args[8], args[9])):",
        "for lane, value in ((args[8], args[9]), (args[6], args[7])):",
        T_SIMD,
        "stream_line_with_ends: the first value wins where both name one lane",
    ),
    Mutant(
        "pad-nhwc-acc-not-reset",
        "pad",
        K_PAD,
        "            acc[:] = 0\n",
        "            pass\n",
        T_PAD,
        "NHWC accumulator carried over from the previous cell",
    ),
    Mutant(
        "pad-last-index-no-border",
        "pad",
        K_IDX,
        "    stop = padded_size if index == size - 1 else index + pad_before + 1",
        "    stop = index + pad_before + 1",
        T_PAD,
        "the last row/column no longer collects the right/bottom border",
    ),
    Mutant(
        "pad-api-pad-equal-size",
        "pad",
        A_PAD,
        "        if pad >= size:",
        "        if pad > size:",
        T_PAD,
        "a pad equal to the dimension accepted",
    ),
    Mutant(
        "pad-api-channels-last-ignored",
        "pad",
        A_PAD,
        "    layout = d.NHWC if nhwc or d.is_channels_last(grad_output) else d.NCHW",
        "    layout = d.NHWC if nhwc else d.NCHW",
        T_PAD,
        "a channels-last gradient gives a C-contiguous result",
    ),
    # ---- half formats (every operator's storage) ---------------------------------------------------
    Mutant(
        "half-bf16-round-toward-zero",
        "halfbits",
        K_HALF,
        "    rounded = builder.lshr(builder.add(builder.add(bits, word(0x7FFF)), builder.and_(top, word(1))), word(16))",
        "    rounded = top",
        T_HALF,
        "bfloat16 encoding truncates instead of rounding to nearest even",
    ),
    Mutant(
        "half-bf16-ties-away",
        "halfbits",
        K_HALF,
        "    rounded = builder.lshr(builder.add(builder.add(bits, word(0x7FFF)), builder.and_(top, word(1))), word(16))",
        "    rounded = builder.lshr(builder.add(bits, word(0x8000)), word(16))",
        T_HALF,
        "bfloat16 ties rounded away from zero instead of to even",
    ),
    # ---- the oracle (fastbwd/testing/reference.py), caught by its own tests ------------------------
    Mutant(
        "ref-pad-backward-clamp",
        "oracle",
        REF,
        "            grad_input[..., _clamp(i - top, 0, H - 1), _clamp(j - left, 0, W - 1)] += g[..., i, j]",
        "            grad_input[..., _clamp(i - top, 0, H - 1), _clamp(j - left, 0, W - 1)] += g[..., i, min(j, g.shape[-1] - 2)]",
        T_REF,
        "pad backward reads the wrong last column",
    ),
    Mutant(
        "ref-pad-forward-top",
        "oracle",
        REF,
        "    rows = np.clip(np.arange(H + top + bottom) - top, 0, H - 1)",
        "    rows = np.clip(np.arange(H + top + bottom) - bottom, 0, H - 1)",
        T_REF,
        "pad forward shifts rows by the bottom pad",
    ),
    Mutant(
        "ref-up-forward-no-clamp",
        "oracle",
        REF,
        "        if src < 0:\n            src = f(0)",
        "        if src < -1:\n            src = f(0)",
        T_REF,
        "upsample oracle's forward does not clamp negative source positions",
    ),
    Mutant(
        "ref-ap-forward-overhang",
        "oracle",
        REF,
        "                div = len(padded_rows) * len(padded_cols)",
        "                div = kH * kW",
        T_REF,
        "pool oracle's forward counts a ceil-mode overhang in the divisor",
    ),
    Mutant(
        "ref-up-no-negative-clamp",
        "oracle",
        REF,
        "                src = max(f(0), ratio * (f(oh) + f(0.5)) - f(0.5))",
        "                src = max(f(-1), ratio * (f(oh) + f(0.5)) - f(0.5))",
        T_REF,
        "upsample oracle does not clamp negative source positions",
    ),
    Mutant(
        "ref-up-negative-scale-set",
        "oracle",
        REF,
        "        ratio = f(1.0 / user_scale) if user_scale > 0 else f(H) / f(OH)",
        "        ratio = f(1.0 / user_scale) if user_scale != 0 else f(H) / f(OH)",
        T_REF,
        "upsample oracle uses a negative scale",
    ),
    Mutant(
        "ref-up-no-identity",
        "oracle",
        REF,
        "        if OH == H:\n            h0 = h1 = oh",
        "        if False:\n            h0 = h1 = oh",
        T_REF,
        "upsample oracle ignores PyTorch's identity rule",
    ),
    Mutant(
        "ref-up-h1-edge",
        "oracle",
        REF,
        "            h1 = h0 + (1 if h0 < H - 1 else 0)",
        "            h1 = h0 + (1 if h0 < H - 2 else 0)",
        T_REF,
        "upsample oracle's second tap stops a row early",
    ),
    Mutant(
        "ref-up-backward-transposed-axes",
        "oracle",
        REF,
        '    out = np.einsum("oh,ncop,pw->nchw", Ah, g, Aw)',
        '    out = np.einsum("oh,ncop,pw->nchw", Ah, g, Aw) * (1 + 1e-6)',
        T_REF,
        "upsample oracle backward scaled by 1 + 1e-6 (caught only by an independent forward/torch)",
    ),
    Mutant(
        "ref-ap-ceil-rule",
        "oracle",
        REF,
        "    if ceil_mode and (out - 1) * s >= H + p:",
        "    if ceil_mode and (out - 1) * s > H + p:",
        T_REF,
        "pool oracle keeps a last window starting in the right padding",
    ),
    Mutant(
        "ref-ap-ceil-overhang-h",
        "oracle",
        REF,
        "            he = min(hs + kH, H + pH)",
        "            he = hs + kH",
        T_REF,
        "pool oracle counts a ceil-mode overhang on the H axis (issue 16)",
    ),
    Mutant(
        "ref-ap-ceil-overhang-w",
        "oracle",
        REF,
        "            we = min(ws + kW, W + pW)",
        "            we = ws + kW",
        T_REF,
        "pool oracle counts a ceil-mode overhang on the W axis",
    ),
    Mutant(
        "ref-ap-exclude-pad",
        "oracle",
        REF,
        "                div = (he - hs) * (we - ws)",
        "                div = pool_size",
        T_REF,
        "pool oracle's count_include_pad=False counts the padding",
    ),
    Mutant(
        "ref-ap-backward-divisor",
        "oracle",
        REF,
        "        grad_input[:, :, hs:he, ws:we] += (g[:, :, oh, ow] / div)[:, :, None, None]",
        "        grad_input[:, :, hs:he, ws:we] += (g[:, :, oh, ow] / abs(div))[:, :, None, None]",
        T_REF,
        "pool oracle's backward ignores the sign of a negative divisor_override",
    ),
    Mutant(
        "ref-gn-swish-scale",
        "oracle",
        REF,
        "        dsw = sig * (1.0 + z * (1.0 - sig))",
        "        dsw = sig * (1.0 + y * (1.0 - sig))",
        T_REF,
        "GroupNorm+Swish oracle's Swish derivative ignores swish_scale in the second term",
    ),
    Mutant(
        "ref-gn-c1",
        "oracle",
        REF,
        "    c1 = (gam[..., 0] * sum_g).sum(axis=2) / M  # (N, G)",
        "    c1 = (gam[..., 0] * sum_g).sum(axis=2) / (M + 1)  # (N, G)",
        T_REF,
        "GroupNorm+Swish oracle's c1 divided by M + 1",
    ),
    # ==== RoIAlign and GroupNorm+Swish (refreshed after the per-pixel weight tables) ==============
    Mutant(
        "roi-aligned-offset",
        "roi_align",
        K_ROI,
        "    offset = like(0.5, zero) if aligned else zero",
        "    offset = zero",
        T_ROI,
        "aligned=True no longer shifts by half a pixel",
    ),
    Mutant(
        "roi-min-size",
        "roi_align",
        K_ROI,
        "        roi_w = max(roi_w, like(1.0, zero))",
        "        roi_w = roi_w",
        T_ROI,
        "unaligned malformed boxes not forced to at least 1 pixel wide",
    ),
    Mutant(
        "roi-adaptive-floor",
        "roi_align",
        K_ROI,
        "        grid_h = like(np.ceil(roi_h / like(pooled_height, zero)), zero)",
        "        grid_h = like(np.floor(roi_h / like(pooled_height, zero)), zero)",
        T_ROI,
        "adaptive sampling grid rounded down",
    ),
    Mutant(
        "roi-sample-test-low",
        "roi_align",
        K_ROI,
        "    if not (position >= -1):\n        return -2",
        "    if not (position >= 0):\n        return -2",
        T_ROI,
        "samples in [-1, 0) skipped instead of clamped to 0",
    ),
    Mutant(
        "roi-weight-no-count",
        "roi_align",
        K_ROI,
        "                    table.weight[slot + used] = weight_sum[q] / np.float64(grid)  # rounded once",
        "                    table.weight[slot + used] = weight_sum[q]  # rounded once",
        T_ROI,
        "per-pixel weights not divided by the bin's sample count",
    ),
    Mutant(
        "roi-closed-form-offset",
        "roi_align",
        K_ROI,
        "                mean = np.float64(bin_origin) + (0.5 * (first + last) + 0.5) * step64",
        "                mean = np.float64(bin_origin) + (0.5 * (first + last)) * step64",
        T_ROI,
        "a long run's closed-form mean position misses the half-sample offset",
    ),
    Mutant(
        "roi-api-batch-trunc",
        "roi_align",
        K_ROI,
        "        image = np.floor(boxes[k, 0]) if finite else -1.0",
        "        image = np.trunc(boxes[k, 0]) if finite else -1.0",
        T_ROI,
        "batch index truncated instead of floored (docs/semantics.md: floor)",
    ),
    Mutant(
        "roi-api-nan-scale",
        "roi_align",
        A_ROI,
        "    if not spatial_scale > FLT_MIN:  # NaN fails too",
        "    if spatial_scale <= FLT_MIN:",
        T_ROI,
        "a NaN spatial_scale accepted",
    ),
    Mutant(
        "gn-abs-gamma",
        "group_norm_swish",
        K_GN_BWD,
        "    y = fma(xhat, gamma, beta)",
        "    y = fma(xhat, abs(gamma), beta)",
        T_GN,
        "|gamma| used in y (issue 16)",
    ),
    Mutant(
        "gn-clamp64",
        "group_norm_swish",
        K_GN_MATH,
        "SWISH_CLAMP64 = np.float64(750.0)",
        "SWISH_CLAMP64 = np.float64(10.0)",
        T_GN,
        "float64 Swish derivative clamped at |s*y| = 10 (issue 16)",
    ),
    Mutant(
        "gn-dx-c1-sign",
        "group_norm_swish",
        K_GN_BWD,
        "    return rstd * fma(gnew, gamma, -fma(xhat, c2, c1))",
        "    return rstd * fma(gnew, gamma, -fma(xhat, c2, -c1))",
        T_GN,
        "dx adds c1 instead of subtracting it",
    ),
    Mutant(
        "gn-c2-count",
        "group_norm_swish",
        K_GN_BWD,
        "    return c1 / count, c2 / count",
        "    return c1 / count, c2 / (count + 1)",
        T_GN,
        "c2 divided by D*HxW + 1",
    ),
    Mutant(
        "gn-sigmoid-sign",
        "group_norm_swish",
        K_GN_MATH,
        "    sig = inv if z >= 0 else other",
        "    sig = other if z >= 0 else inv",
        T_GN,
        "sigmoid of the wrong sign",
    ),
    Mutant(
        "gn-dgamma-first-n",
        "group_norm_swish",
        K_GN_BWD,
        "            acc = sum_gx[0, c]",
        "            acc = sum_g[0, c]",
        T_GN,
        "dgamma starts from sample 0's dbeta sum",
    ),
    Mutant(
        "gn-nhwc-gx-sum",
        "group_norm_swish",
        K_GN_BWD,
        "                lanes_gx[lane + j] += gnew * xhat",
        "                lanes_gx[lane + j] += gnew",
        T_GN,
        "NHWC sum of gnew * xhat drops xhat (both step widths: one position, or PARTIAL_SUMS positions when C <= 320)",
    ),
    Mutant(
        "gn-nhwc-flat-gx-sum",
        "group_norm_swish",
        K_GN_BWD,
        "    for j in range(width, tiled):\n",
        "    for j in range(width, tiled - width):\n",
        T_GN,
        "NHWC steps of PARTIAL_SUMS positions (C <= 320): c1, c2 not tiled for a step's last position",
    ),
    Mutant(
        "gn-nhwc-stream-flat-short",
        "group_norm_swish",
        K_GN_BWD,
        "            copy_out(flat_dx, first, step_dx, 0, size, True)",
        "            copy_out(flat_dx, first, step_dx, 0, size - 1, True)",
        T_GN,
        "NHWC streaming: each step's last dx element is never copied out",
    ),
    Mutant(
        "gn-nhwc-stream-runs-offset",
        "group_norm_swish",
        K_GN_BWD,
        "            copy_out(flat_dx, first, step_dx, 0, size, True)",
        "            copy_out(flat_dx, first - start, step_dx, 0, size, True)",
        T_GN,
        "NHWC channel runs, streaming: dx rows copied out to channel 0 instead of the run's first channel",
    ),
    Mutant(
        "gn-nhwc-direct-flat-offset",
        "group_norm_swish",
        K_GN_BWD,
        "        step_dx = buffer if streaming else flat_dx[first : first + size]",
        "        step_dx = buffer if streaming else flat_dx[first + 1 : first + size + 1]",
        T_GN,
        "NHWC with a scratch, plain stores: each step's dx written one element late",
    ),
    Mutant(
        "gn-nhwc-direct-runs-offset",
        "group_norm_swish",
        K_GN_BWD,
        "        step_dx = buffer if streaming else flat_dx[first : first + size]",
        "        step_dx = buffer if streaming else flat_dx[first - start : first - start + size]",
        T_GN,
        "NHWC channel runs, plain stores: dx rows written at channel 0 instead of the run's first channel",
    ),
    Mutant(
        "gn-nhwc-in-dx-flat-gnew",
        "group_norm_swish",
        K_GN_BWD,
        "                    _dx(load(step_dx[j], fmt), xhat, tile_rstd[j], tile_gamma[j], tile_c1[j], tile_c2[j]), fmt",
        "                    _dx(load(step_x[j], fmt), xhat, tile_rstd[j], tile_gamma[j], tile_c1[j], tile_c2[j]), fmt",
        T_GN,
        "NHWC, gnew kept in dx: the second pass reads x where gnew was kept",
    ),
    Mutant(
        "gn-nhwc-in-dx-runs-stride",
        "group_norm_swish",
        K_GN_BWD,
        "    gnew_stride = channels if in_place else width",
        "    gnew_stride = width",
        T_GN,
        "NHWC channel runs, gnew kept in dx: gnew rows packed at the run's width, not at dx's row stride",
    ),
    Mutant(
        "gn-nhwc-in-dx-runs-start",
        "group_norm_swish",
        K_GN_BWD,
        "    gnew_start = start if in_place else 0",
        "    gnew_start = 0",
        T_GN,
        "NHWC channel runs, gnew kept in dx: every run's gnew rows start at channel 0",
    ),
    Mutant(
        "gn-plan-nhwc-stream-floor",
        "group_norm_swish",
        K_GN,
        "        streaming = work * g.itemsize >= NHWC_STREAM_MIN_BYTES",
        "        streaming = work * g.itemsize > NHWC_STREAM_MIN_BYTES",
        T_GN,
        "the plan's NHWC streaming floor is exclusive: a dx of exactly the floor is stored plainly",
    ),
    Mutant(
        "gn-exp-coefficient",
        "group_norm_swish",
        K_GN_MATH,
        "_P5 = np.float32(5.0000001201e-1)",
        "_P5 = np.float32(4.9e-1)",
        T_GN,
        "float32 exp polynomial off by 1% in its r^2 term",
    ),
    Mutant(
        "gn-api-dbeta-not-zeroed",
        "group_norm_swish",
        A_GN,
        "        dbeta_phys.fill(0)\n",
        "        pass\n",
        T_GN,
        "an out= dbeta given for an unrequired gradient is not zero-filled",
    ),
    Mutant(
        "roi-fwd-leftover-channels",
        "roi_align",
        K_ROI,
        "                        acc[bin_index, c] += load(source[pixel, column + c], fmt) * w\n",
        "                        acc[bin_index, c] += load(source[pixel, column + c], fmt) * wy\n",
        T_ROI,
        "the forward's leftover channels (past the 16-lane groups) ignore the x weight",
    ),
    # ==== RoIAlign's channels-last layout (issue 40) ==============================================
    Mutant(
        "roi-nhwc-load-rows-block",
        "roi_align",
        K_ROI,
        "        values = source[first + i, c0 : c0 + channels]\n",
        "        values = source[first + i, 0:channels]\n",
        T_ROI,
        "NHWC backward: every channel block reads the first block's gradient",
    ),
    Mutant(
        "roi-nhwc-store-rows-block",
        "roi_align",
        K_ROI,
        "        row = destination[first + i, c0 : c0 + channels]  # sliced first, as in _load_rows\n",
        "        row = destination[first + i, 0:channels]  # sliced first, as in _load_rows\n",
        T_ROI,
        "NHWC results: every channel block written over the first block's channels",
    ),
    Mutant(
        "roi-nhwc-untouched-band",
        "roi_align",
        K_ROI,
        "                grad_input[b, row_begin * width : row_end * width, c0:c1] = 0\n",
        "                grad_input[b, row_begin * width : row_end * width, c0:c0] = 0\n",
        T_ROI,
        "NHWC backward: bands no box reaches are left unwritten (out= keeps its old values)",
    ),
    Mutant(
        "roi-nhwc-in-place-zero",
        "roi_align",
        K_ROI,
        "        if in_place:\n            band[:] = 0\n",
        "        if in_place:\n            pass\n",
        T_ROI,
        "NHWC backward accumulating in the result: the band is not zeroed first (out= values leak in)",
    ),
    Mutant(
        "roi-nhwc-fwd-image",
        "roi_align",
        K_ROI,
        '            b = np.searchsorted(image_start, j, side="right") - 1\n',
        '            b = np.searchsorted(image_start, j, side="left") - 1\n',
        T_ROI,
        "channels-last forward: the first box of each image gathers from the image before",
    ),
    Mutant(
        "roi-nhwc-fwd-column",
        "roi_align",
        K_ROI,
        "            _gather_box(source[b], 0, c0, width, acc, j, pooled_height, pooled_width, fmt, y_table, x_table)\n",
        "            _gather_box(source[b], 0, 0, width, acc, j, pooled_height, pooled_width, fmt, y_table, x_table)\n",
        T_ROI,
        "channels-last forward: every channel block gathers the first block's channels",
    ),
    Mutant(
        "roi-nhwc-api-pooled-dims",
        "roi_align",
        A_ROI,
        "    first = 1 if nhwc else 2  # grad_output's pooled dimensions\n",
        "    first = 2  # grad_output's pooled dimensions\n",
        T_ROI,
        "NHWC grad_output's pooled sizes checked against the wrong dimensions",
    ),
    Mutant(
        "torch-ops-roi-grad-format",
        "torch",
        B_OPS,
        "    channels_last = c.memory_format(input) == torch.channels_last\n",
        "    channels_last = False\n",
        T_TORCH,
        "fastbwd.torch.roi_align's input gradient of a channels_last map not channels_last",
    ),
    Mutant(
        "jax-roi-nhwc-input-shape",
        "jax",
        "fastbwd/jax/_roi_align.py",
        '    return (shape[0], shape[3], shape[1], shape[2]) if layout == "NHWC" else tuple(shape)\n',
        "    return tuple(shape)\n",
        "tests/test_jax.py",
        'fastbwd.jax.roi_align with layout="NHWC" plans the backward with an NHWC input_shape',
    ),
    # ---- issue 40's channels-last RoIAlign: an independent audit (kernels, api, bridges) ----
    Mutant(
        "roi-nhwc-in-place-any-block",
        "roi_align",
        K_ROI,
        "        in_place = in_place and channels_last and c1 - c0 == channels\n",
        "        in_place = in_place and channels_last\n",
        T_ROI,
        "NHWC backward accumulates in the result with several channel blocks (C > 256): every block "
        "zeroes and adds into channels 0 : nc of the whole band",
    ),
    Mutant(
        "roi-nhwc-store-band-offset",
        "roi_align",
        K_ROI,
        "            _store_rows(target, grad_input[b], row_begin * width, c0, fmt)\n",
        "            _store_rows(target, grad_input[b], row_begin, c0, fmt)\n",
        T_ROI,
        "NHWC backward through a scratch (half formats, C > 256): a band past the first is stored at "
        "pixel row_begin instead of row_begin * W",
    ),
    Mutant(
        "roi-nhwc-zero-band-channels",
        "roi_align",
        K_ROI,
        "                grad_input[b, row_begin * width : row_end * width, c0:c1] = 0\n",
        "                grad_input[b, row_begin * width : row_end * width, 0 : c1 - c0] = 0\n",
        T_ROI,
        "NHWC backward: a band no box reaches zeroes the first block's channels instead of its own "
        "(C > 256: out= values leak into the later blocks)",
    ),
    Mutant(
        "roi-nhwc-fwd-box-order",
        "roi_align",
        K_ROI,
        "            _store_result(acc, out, box_order[j], c0, result_channels_last, fmt)\n        return\n",
        "            _store_result(acc, out, j, c0, result_channels_last, fmt)\n        return\n",
        T_ROI,
        "channels-last forward: box results stored by table position (sorted by image) instead of the box's own row",
    ),
    Mutant(
        "roi-nhwc-fwd-store-column",
        "roi_align",
        K_ROI,
        "        _store_rows(acc, out[k], 0, c0, fmt)\n",
        "        _store_rows(acc, out[k], 0, 0, fmt)\n",
        T_ROI,
        "NHWC forward result: every channel block (C > 256) stored over the first block's channels",
    ),
    Mutant(
        "roi-nhwc-load-rows-format",
        "roi_align",
        K_ROI,
        "                _load_rows(box, ph * pooled_width, c0, row_grad, fmt)\n",
        "                _load_rows(box, ph * pooled_width, c0, row_grad, NATIVE)\n",
        T_ROI,
        "NHWC backward: float16/bfloat16 grad_output bits read as integers (not decoded)",
    ),
    Mutant(
        "roi-nhwc-axpy-source-transposed",
        "roi_align",
        K_LANE_TILES,
        "        values = decode_lanes(builder, _element_pointer(builder, src, args[4], args[5]), format_name, vector)\n",
        "        values = decode_lanes(builder, _element_pointer(builder, src, args[5], args[4]), format_name, vector)\n",
        T_ROI,
        "the (decode) axpy of the forward gather reads source[column, row] instead of source[row, column]",
    ),
    Mutant(
        "roi-nhwc-api-result-layout",
        "roi_align",
        A_ROI,
        "        channels_last,\n        nhwc,\n",
        "        channels_last,\n        channels_last,\n",
        T_ROI,
        "NCHW forward of a channels-last input (an NHWC array's transpose): the (K, C, PH, PW) result "
        "written in (K, PH, PW, C) order",
    ),
    Mutant(
        "roi-nhwc-api-fwd-cl-source",
        "roi_align",
        A_ROI,
        "        source = d.operand(input, d.NHWC, shape=(batch, pixels, channels))\n",
        "        source = d.operand(input.transpose(0, 3, 1, 2), shape=(batch, pixels, channels))\n",
        T_ROI,
        "NCHW forward of a channels-last input: the wrong permutation (a scrambled copy, not its memory)",
    ),
    Mutant(
        "roi-nhwc-api-fwd-layout-unchecked",
        "roi_align",
        A_ROI,
        "    layout = v.layout(FORWARD, layout)\n",
        "    layout = layout\n",
        T_ROI,
        'roi_align_forward accepts any layout (e.g. "nhwc", None) and runs it as NCHW',
    ),
    Mutant(
        "torch-roi-nhwc-fwd-fake-contiguous",
        "torch",
        B_OPS,
        "        memory_format=c.memory_format(input),\n",
        "        memory_format=torch.contiguous_format,\n",
        f"{T_TORCH} {T_TORCH_OPS}",
        "fake of fastbwd::roi_align says contiguous for a channels_last input (the kernel returns channels_last)",
    ),
    Mutant(
        "torch-roi-nhwc-bwd-fake-contiguous",
        "torch",
        B_OPS,
        "        memory_format=torch.channels_last if channels_last else torch.contiguous_format,\n",
        "        memory_format=torch.contiguous_format,\n",
        f"{T_TORCH} {T_TORCH_OPS}",
        "fake of fastbwd::roi_align_backward says contiguous when channels_last (the kernel returns channels_last)",
    ),
    Mutant(
        "torch-roi-nhwc-grad-contiguous",
        "torch",
        B_OPS,
        "    roi_align_api.run(plan, *arrays, out)\n    return grad_input\n",
        "    roi_align_api.run(plan, *arrays, out)\n    return grad_input.contiguous()\n",
        f"{T_TORCH} {T_TORCH_OPS}",
        "RoIAlign's backward kernel returns a contiguous copy of its channels_last gradient",
    ),
    Mutant(
        "torch-roi-nhwc-fwd-contiguous",
        "torch",
        B_OPS,
        "    memory_format = c.memory_format(input)\n    output = c.empty((rois.shape[0],",
        "    memory_format = torch.contiguous_format\n    output = c.empty((rois.shape[0],",
        f"{T_TORCH} {T_TORCH_OPS}",
        "RoIAlign's forward on a channels_last map runs NCHW (no NHWC kernels) and returns a contiguous result",
    ),
    Mutant(
        "jax-roi-nhwc-layout-dropped",
        "jax",
        "fastbwd/jax/_roi_align.py",
        '        layout = "NHWC" if plan.nhwc else "NCHW"  # validated\n',
        '        layout = "NCHW"  # validated\n',
        "tests/test_jax.py",
        'fastbwd.jax.roi_align ignores layout="NHWC" after validating it (an (N, H, W, C) map run as NCHW)',
    ),
    Mutant(
        "jax-roi-nhwc-pooled-swapped",
        "jax",
        "fastbwd/jax/_roi_align.py",
        "        return (num_boxes,) + tuple(pooled_size) + (channels,)\n",
        "        return (num_boxes,) + tuple(pooled_size)[::-1] + (channels,)\n",
        "tests/test_jax.py",
        'fastbwd.jax.roi_align with layout="NHWC": the result shaped (K, PW, PH, C)',
    ),
    # ==== the api layer's plans (remembered validations) ========================================
    Mutant(
        "plans-scalar-type-ignored",
        "plans",
        PLANS,
        "    if kind in _PLAIN_TYPES:\n        return kind, value\n",
        "    if kind in _PLAIN_TYPES:\n        return value\n",
        T_PLANS,
        "a plan key keeps a scalar's value but not its type (True reuses the plan of 1)",
    ),
    Mutant(
        "plans-sequence-types-ignored",
        "plans",
        PLANS,
        "            return (kind, tuple(value), types)\n",
        "            return (tuple(value),)\n",
        T_PLANS,
        "a plan key of a sequence drops its element types and its own type",
    ),
    Mutant(
        "plans-overlap-not-rechecked",
        "plans",
        DT,
        "        for name, other in zip(names, inputs):\n            if other is not None and _overlaps(out, other):",
        "        for name, other in zip(names, ()):\n            if other is not None and _overlaps(out, other):",
        T_PLANS,
        "a stored plan skips the overlap check of out= (it depends on addresses, not metadata)",
    ),
    Mutant(
        "jit-every-call-one-thread",
        "plans",
        "fastbwd/kernels/_jit.py",
        "        if work is not None and work < ONE_THREAD_BELOW and _forced is None:",
        "        if work is not None and _forced is None:",
        "tests/test_runtime.py",
        "every call with a work size runs on one thread (large ones too)",
    ),
    Mutant(
        "jit-launch-threshold",
        "plans",
        "fastbwd/kernels/_jit.py",
        "(_forced is None and work >= ONE_THREAD_BELOW)",
        "(_forced is None and work > ONE_THREAD_BELOW)",
        "tests/test_runtime.py",
        "a launch of exactly ONE_THREAD_BELOW elements of work runs the serial twin",
    ),
    Mutant(
        "jit-launch-serial-only-ignored",
        "plans",
        "fastbwd/kernels/_jit.py",
        "        if _serial_only:\n            return (self._serial_entry or self._resolve_serial(args))(*args)",
        "        if False:\n            return (self._serial_entry or self._resolve_serial(args))(*args)",
        "tests/test_runtime.py",
        "a planned launch ignores FASTBWD_SERIAL (and the serial switch after fork)",
    ),
    Mutant(
        "plans-writeable-ignored",
        "plans",
        PLANS,
        "            append((value.shape, value.strides, value.dtype, flags.writeable, flags.aligned))",
        "            append((value.shape, value.strides, value.dtype, flags.aligned))",
        T_PLANS,
        "a plan key ignores writeability: a read-only out= reuses a writeable one's plan",
    ),
    Mutant(
        "plans-aligned-ignored",
        "plans",
        PLANS,
        "            append((value.shape, value.strides, value.dtype, flags.writeable, flags.aligned))",
        "            append((value.shape, value.strides, value.dtype, flags.writeable))",
        T_PLANS,
        "a plan key ignores alignment: a misaligned array would reuse launches resolved for aligned ones",
    ),
    # ==== fastbwd.torch (the PyTorch bridge) ==================================================
    Mutant(
        "torch-avg-pool-memory-format",
        "torch",
        B_ROUTING,
        "    memory_format = memory_format or c.memory_format(input)\n    grad_output = c.dense(grad_output, memory_format)\n    divisor",
        "    memory_format = memory_format or c.memory_format(grad_output)\n    grad_output = c.dense(grad_output, memory_format)\n    divisor",
        T_TORCH,
        "routed avg-pool result takes grad_output's memory format instead of the input's",
    ),
    Mutant(
        "torch-zero-divisor",
        "torch",
        B_ROUTING,
        "    if divisor_override == _DIVISOR_UNSET:\n        return None",
        "    if False:\n        return None",
        T_TORCH,
        "PyTorch's divisor_override=0 served by fastbwd as unset instead of PyTorch's error",
    ),
    Mutant(
        "torch-routing-result-format",
        "torch",
        B_ROUTING,
        "    result = grad_input if in_place else c.empty(call.shape, call.dtype, call.memory_format)",
        "    result = grad_input if in_place else c.empty(call.shape, call.dtype)",
        T_TORCH,
        "the routed result is allocated contiguous whatever the memory format (channels_last calls fall back)",
    ),
    Mutant(
        "torch-gn-bias-grad",
        "torch",
        B_OPS,
        "    need_weight, need_bias = needs[1] and weight is not None, needs[2] and bias is not None\n",
        "    need_weight, need_bias = needs[1] and weight is not None, False\n",
        T_TORCH,
        "GroupNormSwish never computes the bias gradient",
    ),
    Mutant(
        "torch-gn-eager-arrays-swapped",
        "torch",
        B_OPS,
        "_KernelArrays(mean, rstd, x, gamma, beta)",
        "_KernelArrays(mean, rstd, x, gamma, gamma)",
        T_TORCH,
        "the eager backward's kept arrays: beta replaced by gamma",
    ),
    Mutant(
        "torch-gn-eager-layout-lost",
        "torch",
        B_OPS,
        "        dy = self.x_array(grad_output)\n",
        "        dy = c.as_array(c.dense(grad_output, torch.contiguous_format))\n",
        T_TORCH,
        "the eager backward forgets channels_last: dy stays NCHW while x is its NHWC view",
    ),
    Mutant(
        "torch-gn-geometry-key-without-strides",
        "torch",
        B_OPS,
        "        input.stride(),\n",
        "",
        T_TORCH_OPS,
        "a channels_last input reuses the geometry of a contiguous one of the same shape",
    ),
    Mutant(
        "torch-gn-geometry-key-without-eps",
        "torch",
        B_OPS,
        "        num_groups,\n        eps,\n        swish_scale,\n",
        "        num_groups,\n        swish_scale,\n",
        T_TORCH_OPS,
        "a call with another eps reuses the first eps's geometry (its eps)",
    ),
    Mutant(
        "torch-gn-eager-skips-checks-of-op-geometry",
        "torch",
        B_OPS,
        "    if check_input is not None and (geometry is None or not geometry.checked):",
        "    if check_input is not None and geometry is None:",
        T_TORCH_OPS,
        "an eager call skips nn.GroupNorm's checks on a geometry the operator made",
    ),
    # ---- float16 runtime calls (targets without F16C) and the vector width ------------------
    Mutant(
        "halfcalls-trunc-ties-up",
        "halfbits",
        "fastbwd/kernels/_halfcalls.py",
        "  %rounded = add i32 %rebiased, %odd",
        "  %rounded = add i32 %rebiased, 1",
        "tests/test_halfcalls.py",
        "float32 -> float16 ties rounded up instead of to even",
    ),
    Mutant(
        "halfcalls-extend-no-quiet",
        "halfbits",
        "fastbwd/kernels/_halfcalls.py",
        "  %special = select i1 %is_nan, i32 %quiet, i32 %special_payload",
        "  %special = select i1 %is_nan, i32 %special_payload, i32 %special_payload",
        "tests/test_halfcalls.py",
        "a signalling float16 NaN widens unquieted (the hardware quiets it)",
    ),
    Mutant(
        "halfcalls-needed-substring",
        "halfbits",
        "fastbwd/kernels/_halfcalls.py",
        '    return "+f16c" not in features.split(",")',
        '    return "f16c" not in features',
        "tests/test_halfcalls.py",
        "a target with -f16c reads as having F16C: its float16 calls find no conversion functions",
    ),
    Mutant(
        "halfcalls-provide-any-present",
        "halfbits",
        "fastbwd/kernels/_halfcalls.py",
        "        if all(llvm.address_of_symbol(name) for name in NAMES):",
        "        if any(llvm.address_of_symbol(name) for name in NAMES):",
        "tests/test_halfcalls.py",
        "one symbol already present: provide() defines neither, the other stays missing",
    ),
    Mutant(
        "halfcalls-provide-replaces-present",
        "halfbits",
        "fastbwd/kernels/_halfcalls.py",
        "            if not llvm.address_of_symbol(name):\n",
        "            if True:\n",
        "tests/test_halfcalls.py",
        "provide() replaces a conversion function the process already defines",
    ),
    Mutant(
        "halfcalls-not-registered",
        "halfbits",
        "fastbwd/kernels/_jit.py",
        "    _halfcalls.provide_if_needed()  # before any kernel is built or loaded from the cache\n",
        "",
        "tests/test_halfcalls.py",
        "no conversion calls for a target without F16C: a float16 call stops the process",
    ),
    Mutant(
        "jit-launch-forgets-torch-threads",
        "plans",
        "fastbwd/kernels/_jit.py",
        "            if torch_threads is not None and torch.get_num_threads() != torch_threads:",
        "            if False:",
        T_TORCH,
        "starting Numba's OpenMP pool leaves PyTorch's thread count at the pool's size",
    ),
    Mutant(
        "jit-narrow-vectors",
        "plans",
        "fastbwd/kernels/_jit.py",
        'set.add(builder.function.attributes, \'"prefer-vector-width"="512"\')',
        'set.add(builder.function.attributes, \'"prefer-vector-width"="256"\')',
        "tests/test_vector_width.py",
        "wide_vectors asks for 256-bit vectors (what LLVM does anyway)",
    ),
    # ---- fastbwd.jax's exit gate (issue 27) ------------------------------------------------------
    Mutant(
        "jax-gate-refuses-while-open",
        "jax",
        J_GATE,
        "  %is_closing = icmp ne i64 %flag, 0",
        "  %is_closing = icmp eq i64 %flag, 0",
        T_EXIT,
        "the gate refuses every call until it is closed, and lets them through after",
    ),
    Mutant(
        "jax-gate-no-exit-hook",
        "jax",
        J_GATE,
        "    atexit.register(_drain)\n",
        "",
        T_EXIT,
        "the gate is never closed: handlers wait for the GIL during finalisation",
    ),
    Mutant(
        "jax-gate-close-without-waiting",
        "jax",
        J_GATE,
        "        while _close() > 0:\n            time.sleep(0.001)",
        "        _close()",
        T_EXIT,
        "the hook closes the gate but does not wait for the calls already inside",
    ),
    Mutant(
        "jax-gate-no-held-results",
        "jax",
        J_GATE,
        "        if not xla_bridge.backends_are_initialized():\n            return",
        "        return",
        T_EXIT,
        "the hook refuses the calls behind arrays the program still holds",
    ),
    Mutant(
        "jax-gate-fork-keeps-count",
        "jax",
        J_GATE,
        "    _state[0] = 0\n    _state[1] = 0",
        "    _state[1] = 0",
        T_EXIT,
        "a forked child inherits its parent's calls in flight and waits for them forever",
    ),
    # ---- the registered operators (fastbwd/torch/_ops.py) ----
    Mutant(
        "torch-ops-roi-autocast-dtype",
        "torch",
        B_OPS,
        "    return output.to(input.dtype)\n",
        "    return output\n",
        T_TORCH_OPS,
        "roi_align under CPU autocast returns float32 instead of the input's dtype",
    ),
    Mutant(
        "torch-ops-roi-double-backward-zero",
        "torch",
        B_OPS,
        "    return (roi_align(grad_grad, rois, *ctx.geometry),) + (None,) * 11\n",
        "    return (torch.zeros((rois.shape[0],) + grad_grad.shape[1:2] + tuple(ctx.geometry[1:3]),\n"
        "                        dtype=grad_grad.dtype),) + (None,) * 11\n",
        T_TORCH_OPS,
        "RoIAlign's double backward silently zero",
    ),
    Mutant(
        "torch-ops-gn-no-composite",
        "torch",
        B_OPS,
        "    if torch.is_grad_enabled() and input.numel() != 0:\n        # A graph of the backward",
        "    if False:\n        # A graph of the backward",
        T_TORCH_OPS,
        "GroupNorm+Swish double backward through the backward operator (misses mean/rstd's dependence on x)",
    ),
    Mutant(
        "torch-ops-gn-fake-layout",
        "torch",
        B_OPS,
        "    y = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))",
        "    y = torch.empty(input.shape, dtype=input.dtype, device=input.device)",
        T_TORCH_OPS,
        "the forward's fake kernel claims a contiguous y for channels_last input",
    ),
    Mutant(
        "torch-ops-explicit-c2",
        "torch",
        B_OPS,
        "    c2 = (scaled * xhat.reshape(grouped)).mean(-1, keepdim=True)\n",
        "    c2 = (scaled * xhat.reshape(grouped)).sum(-1, keepdim=True)\n",
        T_TORCH_OPS,
        "the backward operator's derivative (§5's formula) without the 1/M of c2",
    ),
    Mutant(
        "torch-ops-eager-under-tracing",
        "torch",
        B_OPS,
        "    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():\n        return False\n    return all(",
        "    return True or all(",
        T_TORCH_OPS,
        "kernels run directly (not as operators) even under tracing: torch.compile's AOTAutograd",
    ),
    Mutant(
        "torch-gn-one-value-per-group",
        "torch",
        B_GN,
        "    if values == 1:\n",
        "    if values == 0:\n",
        T_TORCH_OPS,
        "GroupNormSwish accepts one value per group (nn.GroupNorm raises ValueError)",
    ),
    Mutant(
        "torch-roi-list-image-index",
        "torch",
        B_ROI,
        "    images = [torch.full_like(per_image[:, :1], index) for index, per_image in enumerate(boxes)]\n",
        "    images = [torch.full_like(per_image[:, :1], 0) for index, per_image in enumerate(boxes)]\n",
        T_TORCH,
        "a list of boxes all assigned to image 0",
    ),
    # ---- group_norm_swish, the forward (issue 29) ------------------------------------------------
    Mutant(
        "gnf-mean-without-shift",
        "group_norm_swish",
        K_GN_FWD,
        "    group_mean = shift + total / count\n",
        "    group_mean = total / count\n",
        T_GNF,
        "NCHW mean forgets the shift its sums start from",
    ),
    Mutant(
        "gnf-block-short",
        "group_norm_swish",
        K_GN_FWD,
        "            row, block_start, min(block_start + BLOCK, stop), offset, center, other_center, fmt",
        "            row, block_start, min(block_start + BLOCK - 1, stop), offset, center, other_center, fmt",
        T_GNF,
        "NCHW moment sums skip the last element of every block",
    ),
    Mutant(
        "gnf-pair-other-mean-without-shift",
        "group_norm_swish",
        K_GN_FWD,
        "    other_mean = other_shift + other_total / count",
        "    other_mean = other_total / count",
        T_GNF,
        "a two-group NCHW task's second mean forgets its shift",
    ),
    Mutant(
        "gnf-pair-reads-first-group-twice",
        "group_norm_swish",
        K_GN_FWD,
        "                for at, center in zip((position, builder.add(position, offset)), centers)",
        "                for at, center in zip((position, position), centers)",
        T_GNF,
        "the paired moments read the first group's block for the second group as well",
    ),
    Mutant(
        "gnf-pair-second-center",
        "group_norm_swish",
        K_GN_FWD,
        "    t1, t2, other_t1, other_t2 = _moment_sums(row, first, stop, offset, group_mean, other_mean, zero, fmt)",
        "    t1, t2, other_t1, other_t2 = _moment_sums(row, first, stop, offset, group_mean, group_mean, zero, fmt)",
        T_GNF,
        "the second group's centred sums are taken about the first group's mean",
    ),
    Mutant(
        "gn-bwd-gnew-rows-from-first-channel",
        "group_norm_swish",
        K_GN_BWD,
        "        gnew_first = start if in_place else 0",
        "        gnew_first = 0",
        T_GN,
        "an NCHW task keeping gnew in dx writes it over the first group's rows",
    ),
    Mutant(
        "gnf-moments-square",
        "group_norm_swish",
        K_GN_FWD,
        "            return [term for d in deviations for term in (d, builder.fmul(d, d))]",
        "            return [term for d in deviations for term in (d, builder.fmul(d, builder.fadd(d, centers[0])))]",
        T_GNF,
        "centred sum of squares multiplies by x instead of the deviation",
    ),
    Mutant(
        "gnf-moments-center",
        "group_norm_swish",
        K_GN_FWD,
        "                builder.fsub(decode_lanes(builder, builder.gep(x.data, [at]), format_name, vector, used), center)",
        "                decode_lanes(builder, builder.gep(x.data, [at]), format_name, vector, used)",
        T_GNF,
        "the block sum adds x, not x - center",
    ),
    Mutant(
        "gnf-var-no-correction",
        "group_norm_swish",
        K_GN_FWD,
        "    var = (t2 - t1 * (t1 / count)) / count",
        "    var = t2 / count",
        T_GNF,
        "variance without the t1 correction for the mean's rounding (accuracy only)",
    ),
    Mutant(
        "gnf-no-eps",
        "group_norm_swish",
        K_GN_FWD,
        "    return one / math.sqrt(var + eps)",
        "    return one / math.sqrt(var)",
        T_GNF,
        "eps dropped from rstd",
    ),
    Mutant(
        "gnf-shift-nonfinite",
        "group_norm_swish",
        K_GN_FWD,
        "    return first if abs(first) < math.inf else zero",
        "    return first",
        T_GNF,
        "an infinite first element shifts its group's sums (mean NaN instead of inf)",
    ),
    Mutant(
        "gnf-shift-negative-infinity",
        "group_norm_swish",
        K_GN_FWD,
        "    return first if abs(first) < math.inf else zero",
        "    return first if first < math.inf else zero",
        T_GNF,
        "-inf as a group's first element shifts its sums (mean NaN instead of -inf; issue 39)",
    ),
    Mutant(
        "gnf-pair-second-shift-unguarded",
        "group_norm_swish",
        K_GN_FWD,
        "    other_shift = _shift_of(load(row[first + offset], fmt), zero)",
        "    other_shift = load(row[first + offset], fmt)",
        T_GNF,
        "a paired task's second group is shifted by its first element even when that is not finite (issue 39)",
    ),
    Mutant(
        "gnf-swish-sign",
        "group_norm_swish",
        K_GN_MATH,
        "    return (y if z >= 0 else y * e) / (_ONE32 + e)",
        "    return (y * e if z >= 0 else y) / (_ONE32 + e)",
        T_GNF,
        "float32 sigmoid of the wrong sign in the forward's Swish",
    ),
    Mutant(
        "gnf-nchw-activate-ignored",
        "group_norm_swish",
        K_GN_FWD,
        "    if activate_swish:\n        for i in range(x_row.shape[0]):",
        "    if True:\n        for i in range(x_row.shape[0]):",
        T_GNF,
        "NCHW applies Swish with activate_swish False",
    ),
    Mutant(
        "gnf-nchw-abs-gamma",
        "group_norm_swish",
        K_GN_FWD,
        "            x[n, c], y[n, c], mean[n, group], rstd[n, group] * gamma[c], beta[c], activate_swish, swish_scale, fmt",
        "            x[n, c], y[n, c], mean[n, group], rstd[n, group] * abs(gamma[c]), beta[c], activate_swish, swish_scale, fmt",
        T_GNF,
        "NCHW scales by |gamma|",
    ),
    Mutant(
        "gnf-nhwc-activate-ignored",
        "group_norm_swish",
        K_GN_FWD,
        "        if activate_swish:\n            for k in range(width):",
        "        if True:\n            for k in range(width):",
        T_GNF,
        "NHWC applies Swish with activate_swish False",
    ),
    Mutant(
        "gnf-nhwc-gamma-offset",
        "group_norm_swish",
        K_GN_FWD,
        "            scale[k] = group_rstd * gamma[start + k]",
        "            scale[k] = group_rstd * gamma[k]",
        T_GNF,
        "NHWC runs after the first read gamma from channel 0",
    ),
    Mutant(
        "gnf-nhwc-shift-per-channel",
        "group_norm_swish",
        K_GN_FWD,
        "        center[k] = _shift_of(load(x[n, 0, start + (k // group_size) * group_size], fmt), zero)",
        "        center[k] = _shift_of(load(x[n, 0, start + k], fmt), zero)",
        T_GNF,
        "NHWC shifts each channel by its own first element, the mean by the group's",
    ),
    Mutant(
        "gnf-nhwc-last-block-only",
        "group_norm_swish",
        K_GN_FWD,
        "        total_d += block_d\n",
        "        total_d[:] = block_d\n",
        T_GNF,
        "NHWC per-channel sums keep only the last block of positions",
    ),
    Mutant(
        "gnf-api-mean-from-rstd",
        "group_norm_swish",
        A_GN,
        "        mean[...] = mean_c\n",
        "        mean[...] = rstd_c\n",
        T_GNF,
        "statistics in a dtype other than the compute type: mean copied from rstd",
    ),
    Mutant(
        "gnf-api-eps-inf",
        "group_norm_swish",
        A_GN,
        "    if not 0 <= eps < math.inf:",
        "    if not 0 <= eps:",
        T_GNF,
        "an infinite eps accepted",
    ),
    # ---- fuse_group_norm_swish (issue 37: FusedGroupNorm's lazy output, deciding at run time) ----
    Mutant(
        "fuse-used-twice",
        "torch",
        B_FUSE,
        "        if len(record.uses) > 1:",
        "        if len(record.uses) > 2:",
        T_FUSE,
        "a GroupNorm whose output is used twice is fused",
    ),
    Mutant(
        "fuse-first-use-any",
        "torch",
        B_FUSE,
        "        if record.uses and not record.uses[0].silu:",
        "        if record.uses and not record.uses[-1].silu:",
        T_FUSE,
        "an output that goes through another operation before its SiLU counts as a pair",
    ),
    Mutant(
        "fuse-kept-output",
        "torch",
        B_FUSE,
        "    alive = [record.output() for record in records if record.output() is not None]",
        "    alive = []",
        T_FUSE,
        "an output still referenced after its call (kept, returned) is fused",
    ),
    Mutant(
        "fuse-silu-subclass",
        "torch",
        B_FUSE,
        "    return isinstance(owner, nn.SiLU) and type(owner) is not nn.SiLU",
        "    return False",
        T_FUSE,
        "F.silu inside an nn.SiLU subclass counts as a SiLU",
    ),
    Mutant(
        "fuse-sequential-any-silu",
        "torch",
        B_FUSE,
        "and type(following) is nn.SiLU and not _refusal(norm):",
        "and isinstance(following, nn.SiLU) and not _refusal(norm):",
        T_FUSE,
        "nn.Sequential: a GroupNorm followed by an nn.SiLU subclass becomes a GroupNormSwish",
    ),
    Mutant(
        "fuse-metadata-computes",
        "torch",
        B_FUSE,
        "        if func in _METADATA and type(args[0]) is cls:",
        "        if False:",
        T_FUSE,
        "reading the lazy output's shape computes it (and loses the fusion)",
    ),
    Mutant(
        "fuse-input-strides",
        "torch",
        B_FUSE,
        "            result, strides = None, geometry.output_strides",
        "            result, strides = None, input.stride()",
        T_FUSE,
        "the lazy output claims the input's strides instead of F.group_norm's",
    ),
    Mutant(
        "fuse-requires-grad-any-mode",
        "torch",
        B_FUSE,
        "        requires_grad = grad and (",
        "        requires_grad = (",
        T_FUSE,
        "the lazy output requires grad under torch.no_grad()",
    ),
    Mutant(
        "fuse-grad-mode-of-the-silu",
        "torch",
        B_FUSE,
        "        with _grad_mode(self._fb_grad and torch.is_grad_enabled()):",
        "        with _grad_mode(torch.is_grad_enabled()):",
        T_FUSE,
        "a GroupNorm called under no_grad whose SiLU runs with grad gives a result that requires grad",
    ),
    Mutant(
        "fuse-no-disarm",
        "torch",
        B_FUSE,
        "            if self._fb_consumed:",
        "            if False:",
        T_FUSE,
        "a use after the fused SiLU neither warns nor disarms",
    ),
    Mutant(
        "fuse-inplace-silu-open",
        "torch",
        B_FUSE,
        "                record.closed = use.silu and silu_inplace",
        "                record.closed = False",
        T_FUSE,
        "uses after an in-place SiLU count as uses of the GroupNorm's output",
    ),
    Mutant(
        "fuse-no-version-check",
        "torch",
        B_FUSE,
        "            self._fb_versions is not None\n",
        "            False\n",
        T_FUSE,
        "an input modified in place before the first use is normalised as modified",
    ),
    Mutant(
        "fuse-rng-not-forked",
        "torch",
        B_FUSE,
        "        with torch.random.fork_rng(devices=[]), torch.no_grad():",
        "        with torch.no_grad():",
        T_FUSE,
        "the example forward advances the caller's RNG",
    ),
    Mutant(
        "fuse-buffers-kept",
        "torch",
        B_FUSE,
        "                buffer.copy_(value)",
        "                pass",
        T_FUSE,
        "the example forward's BatchNorm statistics stay in the model",
    ),
    Mutant(
        "fuse-never-decides",
        "torch",
        B_FUSE,
        "        if not (self._fusion_live and self.fusion_state == _OBSERVING and self._fusion_records):",
        "        if not (self._fusion_live and self.fusion_state == _PENDING and self._fusion_records):",
        T_FUSE,
        "without example inputs a GroupNorm observes forever",
    ),
    Mutant(
        "fuse-not-only-eager",
        "torch",
        B_FUSE,
        "        if not _ops.use_eager_path(input) or input.device.type",
        "        if input.device.type",
        T_FUSE,
        "autocast, functorch or fake tensors reach the lazy output",
    ),
    # ---- torch.compile: the compiler hooks and the graph operators (issue 36) -------------------
    Mutant(
        "compile-guard-no-upper-bound",
        "torch",
        B_COMPILE,
        "    if not low <= version <= high:",
        "    if not low <= version:",
        T_COMPILE,
        "a PyTorch newer than 2.14 gets the private hooks instead of one warning and plain torch.compile",
    ),
    Mutant(
        "compile-guard-raises",
        "torch",
        B_COMPILE,
        "                    RuntimeWarning,\n                    stacklevel=3,\n                )\n",
        "                    RuntimeWarning,\n"
        "                    stacklevel=3,\n"
        "                )\n"
        "                raise RuntimeError(reason)\n",
        T_COMPILE,
        "an unsupported PyTorch makes enable() raise instead of warning once (eager routing lost)",
    ),
    Mutant(
        "compile-upsample-scales-swapped",
        "torch",
        B_COMPILE,
        "    backward_arguments = (list(output_size), list(input.shape), align_corners, scales_h, scales_w)",
        "    backward_arguments = (list(output_size), list(input.shape), align_corners, scales_w, scales_h)",
        T_COMPILE,
        "compiled upsample backward: scales_h and scales_w swapped (scale_factor=(2, 3))",
    ),
    Mutant(
        "compile-upsample-vec-scales-dropped",
        "torch",
        B_COMPILE,
        "    scales = scale_factors if scale_factors else [None, None]",
        "    scales = [None, None]",
        T_COMPILE,
        "compiled F.interpolate(scale_factor=1.7): the .vec overload drops the scales (in/out ratios used)",
    ),
    Mutant(
        "compile-upsample-vec-composite-missing",
        "torch",
        B_COMPILE,
        "    (aten.upsample_bilinear2d.vec, _COMPOSITE): _upsample_bilinear2d_vec,\n",
        "",
        T_COMPILE,
        "the .vec composite kernel not replaced: F.interpolate/nn.Upsample backward stays PyTorch's scatters",
    ),
    Mutant(
        "compile-avg-pool-empty-stride",
        "torch",
        B_COMPILE,
        "    stride = _pair(stride) if stride else kernel_size",
        "    stride = _pair(stride) if stride else [1, 1]",
        T_COMPILE,
        "compiled F.avg_pool2d(x, k) (no stride): the backward uses stride 1 instead of the kernel size",
    ),
    Mutant(
        "compile-avg-pool-count-include-pad-ignored",
        "torch",
        B_COMPILE,
        "    backward_arguments = (kernel_size, stride, _pair(padding), ceil_mode, count_include_pad, divisor_override)",
        "    backward_arguments = (kernel_size, stride, _pair(padding), ceil_mode, True, divisor_override)",
        T_COMPILE,
        "compiled avg-pool backward ignores count_include_pad=False",
    ),
    Mutant(
        "compile-pad-left-right-swapped",
        "torch",
        B_COMPILE,
        '    return _RoutedForward.apply("replication_pad2d_backward", forward, (list(padding),), input, padding)',
        "    swapped = [padding[1], padding[0], *padding[2:]]\n"
        '    return _RoutedForward.apply("replication_pad2d_backward", forward, (swapped,), input, padding)',
        T_COMPILE,
        "compiled replicate-pad backward gets left and right padding swapped",
    ),
    Mutant(
        "compile-user-pre-grad-pass-dropped",
        "torch",
        B_COMPILE,
        "        _passes_set = _as_list(_passes_before) + [_graph_pass()]",
        "        _passes_set = [_graph_pass()]",
        T_COMPILE,
        "enable() replaces the user's Inductor pre_grad_custom_pass instead of running beside it",
    ),
    Mutant(
        "compile-user-joint-pass-dropped",
        "torch",
        B_COMPILE,
        "        if previous is not None:\n            gm = previous(gm, inputs)",
        "        if False:\n            gm = previous(gm, inputs)",
        T_COMPILE,
        "the user's AOTAutograd joint_custom_pass no longer runs while enabled",
    ),
    Mutant(
        "compile-fuse-used-twice",
        "torch",
        B_COMPILE,
        '    if node.op != "call_function" or node.target not in _GROUP_NORMS or len(node.users) != 1:\n'
        "        return None\n"
        "    (silu,) = node.users",
        '    if node.op != "call_function" or node.target not in _GROUP_NORMS or not node.users:\n'
        "        return None\n"
        "    silu = next(iter(node.users))",
        T_COMPILE,
        "a GroupNorm whose output is used elsewhere too is fused when a SiLU is among its users",
    ),
    Mutant(
        "compile-fuse-any-follower",
        "torch",
        B_COMPILE,
        '    if silu.op != "call_function" or silu.target not in _SILUS or silu.args != (node,):',
        '    if silu.op != "call_function" or silu.args != (node,):',
        T_COMPILE,
        "GroupNorm followed by any function (relu, an nn.SiLU subclass's own forward) is fused as GroupNorm+SiLU",
    ),
    Mutant(
        "compile-fuse-default-eps",
        "torch",
        B_COMPILE,
        "    values = dict(zip(names, (None, None, None, None, 1e-5)))",
        "    values = dict(zip(names, (None, None, None, None, 1e-3)))",
        T_COMPILE,
        "F.group_norm without eps fused with eps 1e-3 instead of PyTorch's default 1e-5",
    ),
    Mutant(
        "compile-gn-silu-disabled-runs-fastbwd",
        "torch",
        B_COMPILE,
        '    _routing.GRAPH_CALLS["group_norm_silu"] += 1\n    if _routing.is_enabled():',
        '    _routing.GRAPH_CALLS["group_norm_silu"] += 1\n    if True:',
        T_COMPILE,
        "fastbwd::group_norm_silu runs fastbwd's kernel after disable() instead of native_group_norm + silu",
    ),
    Mutant(
        "compile-gn-silu-backward-disabled-composite",
        "torch",
        B_COMPILE,
        "        torch.ops.aten.silu_backward(grad_output, y),",
        "        grad_output * torch.sigmoid(y) * (1 + y * (1 - torch.sigmoid(y))),",
        T_COMPILE,
        "disabled fused backward: SiLU's derivative written out instead of aten's silu_backward (not PyTorch's bits)",
    ),
    Mutant(
        "compile-gn-silu-fake-contiguous",
        "torch",
        B_COMPILE,
        "    y = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=c.memory_format(input))",
        "    y = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=torch.contiguous_format)",
        T_COMPILE,
        "fake kernel of fastbwd::group_norm_silu says contiguous for a channels_last input",
    ),
    Mutant(
        "compile-gn-silu-no-bias-grad",
        "torch",
        B_COMPILE,
        "    mask = [needs[0], needs[1] and weight is not None, needs[2] and bias is not None]",
        "    mask = [needs[0], needs[1] and weight is not None, False]",
        T_COMPILE,
        "a fused GroupNorm+SiLU under Inductor gives the GroupNorm's bias no gradient",
    ),
    Mutant(
        "compile-gn-silu-no-double-backward",
        "torch",
        B_COMPILE,
        "    if torch.is_grad_enabled():  # a graph of the backward",
        "    if False:  # a graph of the backward",
        T_COMPILE,
        "fastbwd::group_norm_silu's backward is not differentiable (create_graph / double backward fails)",
    ),
    Mutant(
        "compile-joint-mean-rstd-swapped",
        "torch",
        B_COMPILE,
        "                outputs[1],\n                outputs[2],",
        "                outputs[2],\n                outputs[1],",
        T_COMPILE,
        "joint-graph pass (aot_eager) hands the fused backward rstd as mean and mean as rstd",
    ),
    Mutant(
        "compile-joint-inplace-silu-not-fused",
        "torch",
        B_COMPILE,
        '    if saved.op == "call_function" and saved.target is aten.clone.default and len(saved.users) == 1:',
        "    if False:",
        T_COMPILE,
        "joint-graph pass (aot_eager) no longer fuses a GroupNorm followed by nn.SiLU(inplace=True)",
    ),
    Mutant(
        "compile-graph-fake-contiguous",
        "torch",
        B_ROUTING,
        "        memory_format = result_format(name, args[0], args[1])\n        grad_output = args[0]",
        "        memory_format = torch.contiguous_format\n        grad_output = args[0]",
        T_COMPILE,
        "fake kernels of the routed graph operators say contiguous (channels_last input: stride assertion)",
    ),
    Mutant(
        "compile-result-format-grad-output",
        "torch",
        B_ROUTING,
        "    return c.memory_format(input_or_size if ROUTES[name].tensors == 2 else grad_output)",
        "    return c.memory_format(grad_output)",
        T_COMPILE,
        "graph operators' result follows grad_output's memory format (pool, pad: the input's)",
    ),
    Mutant(
        "compile-upsample-schema-int-sizes",
        "torch",
        B_ROUTING,
        '"(Tensor grad_output, SymInt[2] output_size, SymInt[4] input_size, "',
        '"(Tensor grad_output, int[2] output_size, int[4] input_size, "',
        T_COMPILE,
        "upsample graph operator takes int[] sizes: dynamic=True specialises (one graph per shape)",
    ),
    Mutant(
        "compile-upsample-double-backward-align-corners",
        "torch",
        B_ROUTING,
        "        torch.ops.aten.upsample_bilinear2d(grad, output_size, align_corners, scales_h, scales_w),",
        "        torch.ops.aten.upsample_bilinear2d(grad, output_size, not align_corners, scales_h, scales_w),",
        T_COMPILE,
        "derivative of fastbwd::upsample_bilinear2d_backward flips align_corners",
    ),
    Mutant(
        "compile-disable-keeps-hooks",
        "torch",
        B_ROUTING,
        "        _active = False\n        _compile.uninstall()",
        "        _active = False",
        T_COMPILE,
        "disable() leaves the compiler hooks in: graphs compiled while disabled get fastbwd nodes",
    ),
    # ---- result cache (fastbwd/_result_cache.py and its call sites) ----------------------------
    Mutant(
        "cache-reuse-while-viewed",
        "api",
        RC,
        "            raw = _idle.pop(key)\n            _take(nbytes, key)",
        "            raw = _idle[key]",
        T_CACHE,
        "a reused block stays in the cache: the next result of that size shares memory with a live one",
    ),
    Mutant(
        "cache-result-not-owned-by-block",
        "api",
        RC,
        "    return np.asarray(_Block(raw)).view(dtype).reshape(shape)",
        "    _Block(raw)\n    return raw.view(dtype).reshape(shape)",
        T_CACHE,
        "the result views raw, not its _Block: the block goes back at once and is reused while viewed",
    ),
    Mutant(
        "cache-take-not-counted",
        "api",
        RC,
        "    _idle_bytes -= nbytes",
        "    _idle_bytes -= 0",
        T_CACHE,
        "taking a block does not lower the kept byte count: the count drifts up and the cache stops keeping blocks",
    ),
    Mutant(
        "cache-give-back-not-counted",
        "api",
        RC,
        "        _idle_bytes += raw.nbytes",
        "        pass",
        T_CACHE,
        "blocks given back are not counted: the limit is never reached, kept memory grows without bound (leak)",
    ),
    Mutant(
        "cache-limit-off-by-one-block",
        "api",
        RC,
        "        while _idle_bytes + raw.nbytes > LIMIT:",
        "        while _idle_bytes > LIMIT:",
        T_CACHE,
        "eviction ignores the incoming block: up to LIMIT plus one block kept, over the documented limit",
    ),
    Mutant(
        "cache-evict-newest",
        "api",
        RC,
        "            _, oldest = _idle.popitem(last=False)",
        "            _, oldest = _idle.popitem(last=True)",
        T_CACHE,
        "eviction drops the block kept most recently instead of the one kept longest",
    ),
    Mutant(
        "cache-take-wrong-key",
        "api",
        RC,
        "    keys.remove(key)",
        "    keys.pop()",
        T_CACHE,
        "the size index drops the newest id, not the taken one: after an eviction it names a freed block (KeyError)",
    ),
    Mutant(
        "cache-no-fork-handler",
        "api",
        RC,
        "os.register_at_fork(after_in_child=_after_fork_in_child)",
        "pass  # no fork handler",
        T_CACHE,
        "no fork handler: a lock held by another thread at the fork stays held in the child (hang)",
    ),
    Mutant(
        "cache-fork-keeps-lock",
        "api",
        RC,
        "    global _lock\n    _lock = threading.Lock()\n    _forget_all()",
        "    _forget_all()",
        T_CACHE,
        "the child forgets the blocks but keeps the parent's lock: held by another thread at the fork, it hangs",
    ),
    Mutant(
        "cache-threshold-boundary",
        "api",
        RC,
        "    if nbytes < SMALLEST or nbytes > LIMIT:",
        "    if nbytes <= SMALLEST or nbytes > LIMIT:",
        T_CACHE,
        "a result of exactly 4 MiB is not cached (documented: 4 MiB and more)",
    ),
    Mutant(
        "cache-readonly-result",
        "api",
        RC,
        '"data": (raw.ctypes.data, False),',
        '"data": (raw.ctypes.data, True),',
        T_CACHE,
        "the block is exported read-only: large results are not writeable",
    ),
    Mutant(
        "cache-env-not-finite",
        "api",
        RC,
        "    if not math.isfinite(megabytes):\n        megabytes = 256.0",
        "",
        T_CACHE,
        "FASTBWD_RESULT_CACHE_MB=inf or nan makes import fastbwd raise (int of inf/nan)",
    ),
    Mutant(
        "cache-clear-does-nothing",
        "api",
        RC,
        "    with _lock:\n        _forget_all()",
        "    pass",
        T_CACHE,
        "fastbwd.clear_result_cache() frees nothing: the kept memory stays",
    ),
    Mutant(
        "cache-output-bypassed",
        "api",
        DT,
        "        phys = np.empty(spec.physical, spec.dtype) if spec.small else empty(spec.physical, spec.dtype)",
        "        phys = np.empty(spec.physical, spec.dtype)",
        f"{T_CACHE} tests/test_api.py",
        "the one allocation path (_dtypes.allocate) uses np.empty: large results never reuse memory",
    ),
    Mutant(
        "cache-gns-backward-bypassed",
        "api",
        DT,
        "    small = math.prod(physical) * dtype.itemsize < _result_cache.SMALLEST",
        "    small = True",
        f"{T_CACHE} tests/test_group_norm_swish.py",
        "every result (GroupNorm+Swish backward's dx too) is taken as small: it bypasses the cache",
    ),
    Mutant(
        "cache-torch-empty-bypassed",
        "api",
        CONV,
        "        return as_tensor(d.empty(tuple(shape), ARRAY_DTYPES[dtype]))",
        "        return as_tensor(np.empty(tuple(shape), ARRAY_DTYPES[dtype]))",
        f"{T_CACHE} tests/test_torch.py",
        "the torch bridge's contiguous results bypass the cache",
    ),
    Mutant(
        "cache-torch-channels-last-bypassed",
        "api",
        CONV,
        "    return as_tensor(d.empty(physical, ARRAY_DTYPES[dtype])).permute(*to_logical)",
        "    return as_tensor(np.empty(physical, ARRAY_DTYPES[dtype])).permute(*to_logical)",
        f"{T_CACHE} tests/test_torch.py",
        "the torch bridge's channels_last results bypass the cache",
    ),
    Mutant(
        "cache-gns-forward-bypassed",
        "api",
        DT,
        "(shape, strides, dtype), dtype in _FORMATS, small)",
        "(shape, strides, dtype), dtype in _FORMATS, True)",
        f"{T_CACHE} tests/test_group_norm_swish_forward.py",
        "a Result is always small (GroupNorm+Swish forward's y too): it bypasses the cache",
    ),
    Mutant(
        "cache-give-back-blocks",
        "api",
        RC,
        "    if raw.nbytes > LIMIT or not _lock.acquire(blocking=False):",
        "    if raw.nbytes > LIMIT or not _lock.acquire():",
        T_CACHE,
        "a dying result waits for the lock: a view dying while its own thread holds it deadlocks",
    ),
]

#: Names of the mutants whose snippets the lead refreshes after the RoIAlign/GroupNorm rewrites.
REWRITTEN_OPS = ("roi_align", "group_norm_swish")


def tree_files(root):
    """The files of the working tree: tracked (as they are on disk, uncommitted edits included)
    plus untracked ones that are not ignored; deleted files are skipped."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return sorted({name for name in listed if name and os.path.isfile(os.path.join(root, name))})


def copy_tree(root, files, destination):
    for name in files:
        target = os.path.join(destination, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, name), target)


def apply(mutant, tree):
    """Apply ``mutant`` to the copy at ``tree``; None on success, else why it is stale."""
    path = os.path.join(tree, mutant.file)
    if not os.path.isfile(path):
        return f"{mutant.file} does not exist"
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    count = text.count(mutant.original)
    if count != 1:
        return f"snippet found {count} times in {mutant.file}"
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text.replace(mutant.original, mutant.replacement))
    return None


def run_tests(tree, test, timeout):
    """Run ``test`` in ``tree``: ``(passed, timed_out, seconds, tail of the output)``."""
    with tempfile.TemporaryDirectory(prefix="fastbwd-inductor-") as inductor_cache:
        # Inductor's caches key fastbwd's pass by _compile.py alone: with the shared default folder
        # a mutant elsewhere (a fake kernel, a schema) would load the graphs compiled unmutated
        env = dict(os.environ, FASTBWD_CACHE="0", PYTHONDONTWRITEBYTECODE="1", TORCHINDUCTOR_CACHE_DIR=inductor_cache)
        env.pop("PYTHONPATH", None)
        return _run_pytest(tree, test, timeout, env)


def _run_pytest(tree, test, timeout, env):
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *shlex.split(test), "-x", "-q", "-p", "no:cacheprovider"],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the test run and any subprocess it started
        output, _ = process.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    lines = [line for line in (output or "").splitlines() if line.strip()]
    return process.returncode == 0 and not timed_out, timed_out, seconds, "\n".join(lines[-3:])


def evaluate(mutant, snapshot, files, timeout, baseline_failed):
    if mutant.test in baseline_failed:
        return {"outcome": "baseline-failed", "seconds": 0.0, "detail": f"{mutant.test} fails unmutated"}
    with tempfile.TemporaryDirectory(prefix="fastbwd-mutant-") as tree:
        copy_tree(snapshot, files, tree)
        stale = apply(mutant, tree)
        if stale:
            return {"outcome": "stale", "seconds": 0.0, "detail": stale}
        passed, timed_out, seconds, tail = run_tests(tree, mutant.test, timeout)
    if timed_out:
        outcome = "killed (timeout)"
    else:
        outcome = "survived" if passed else "killed"
    return {"outcome": outcome, "seconds": round(seconds, 1), "detail": tail.splitlines()[-1] if tail else ""}


def baseline(tests, snapshot, files, timeout, jobs):
    """Each test file once, unmutated: the set of files that fail."""

    def one(test):
        with tempfile.TemporaryDirectory(prefix="fastbwd-baseline-") as tree:
            copy_tree(snapshot, files, tree)
            passed, timed_out, seconds, tail = run_tests(tree, test, timeout)
        print(
            f"baseline {test}: {'ok' if passed else 'FAILED'} ({seconds:.0f} s)" + ("" if passed else f"\n    {tail}"),
            flush=True,
        )
        return test, passed

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return {test for test, passed in pool.map(one, sorted(tests)) if not passed}


def selected(names):
    if not names:
        return list(MUTANTS)
    chosen = [m for m in MUTANTS if any(m.name.startswith(n) or m.op == n for n in names)]
    if not chosen:
        sys.exit(f"no mutant matches {names}")
    return chosen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="mutant name prefixes or op names")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per test run (default 1200)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    parser.add_argument("--results", metavar="FILE", help="append one JSON line per mutant to FILE")
    args = parser.parse_args(argv)

    mutants = selected(args.only)
    names = [m.name for m in MUTANTS]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        sys.exit(f"duplicate mutant names: {sorted(duplicates)}")
    if args.list:
        stale = 0
        for m in mutants:
            path = os.path.join(ROOT, m.file)
            found = open(path, encoding="utf-8").read().count(m.original) if os.path.isfile(path) else 0
            mark = "" if found == 1 else f"  [STALE: found {found} times]"
            stale += found != 1
            print(f"{m.name:34} {m.op:17} {m.file:40} {m.test:36} {m.description}{mark}")
        print(f"{len(mutants)} mutants, {stale} stale")
        return 1 if stale else 0

    # One snapshot of the working tree for the whole run: edits made while it runs do not leak in.
    snapshot = tempfile.mkdtemp(prefix="fastbwd-snapshot-")
    try:
        copy_tree(ROOT, tree_files(ROOT), snapshot)
        return _run(args, mutants, snapshot, _listed(snapshot))
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)


def _listed(tree):
    return sorted(
        os.path.relpath(os.path.join(folder, name), tree) for folder, _, names in os.walk(tree) for name in names
    )


def _run(args, mutants, snapshot, files):
    baseline_failed = (
        set() if args.no_baseline else baseline({m.test for m in mutants}, snapshot, files, args.timeout, args.jobs)
    )
    results = {}
    started = time.monotonic()

    def one(mutant):
        return mutant, evaluate(mutant, snapshot, files, args.timeout, baseline_failed)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for mutant, result in pool.map(one, mutants):
            results[mutant.name] = result
            print(
                f"{result['outcome']:17} {mutant.name:34} {result['seconds']:7.1f} s  {mutant.description}"
                + (f"\n{'':19}{result['detail']}" if result["outcome"] in ("stale", "baseline-failed") else ""),
                flush=True,
            )
            if args.results:
                with open(args.results, "a", encoding="utf-8") as handle:
                    handle.write(
                        json.dumps(
                            {"name": mutant.name, "op": mutant.op, "file": mutant.file, "test": mutant.test, **result}
                        )
                        + "\n"
                    )

    counts = collections.Counter(r["outcome"] for r in results.values())
    killed = counts["killed"] + counts["killed (timeout)"]
    scored = killed + counts["survived"] + counts["stale"]
    print(
        f"\n{len(results)} mutants in {time.monotonic() - started:.0f} s: killed {counts['killed']}, "
        f"killed by timeout {counts['killed (timeout)']}, survived {counts['survived']}, "
        f"stale {counts['stale']}, baseline-failed {counts['baseline-failed']}"
    )
    if scored:
        print(f"score {killed}/{scored} = {100 * killed / scored:.1f}%")
    for outcome in ("survived", "stale", "baseline-failed"):
        names = [name for name, r in results.items() if r["outcome"] == outcome]
        if names:
            print(f"{outcome}: {', '.join(names)}")
    return 0 if killed == scored and not counts["baseline-failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
