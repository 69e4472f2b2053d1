"""How XLA partitions fastbwd's FFI calls over devices (docs/design.md, "Sharding").

XLA cannot look inside an FFI call, so on its own it gathers every sharded operand onto every
device and runs the whole call on each. Each operator therefore describes its call with a
:class:`Split`: for every dimension of every operand and result, a *label* when the call splits
along it into independent calls on slices (the batch, the channels), or None when the kernel
needs that dimension whole. The same label on two arrays is the same index (a batch row of the
gradient is the batch row of the input). From that one description :func:`call` builds:

* a ``jax.experimental.custom_partitioning`` wrapper of the FFI call, with a Shardy sharding
  rule (labels are factors; the whole dimensions are ``need_replication`` factors) for XLA's
  propagation, and, at partitioning time, the per-device program: each label takes the mesh
  axes its first sharded array gives it (a mesh axis goes to one label only, and only when the
  slices come out even), every array is asked for in that sharding, and each device runs the
  FFI call on its slices. A result that sums over a label (GroupNorm's weight gradient over the
  batch) is ``psum``-ed over that label's axes; RoIAlign's hooks (``localize``, ``finish``)
  shift its boxes' image indices into the device's own images. A sharding no label can take
  (a spatial axis, or slices that do not come out even) is gathered by XLA: slower, never wrong.
* a ``jax.custom_batching.custom_vmap`` rule (``custom_partitioning`` has none), which keeps
  the transport's vmap behaviours (``ffi_call``'s ``vmap_method``): ``"broadcast_all"`` gives
  every operand the new axis (the handler folds it into N), ``"expand_dims"`` gives the others
  one of size 1, ``"sequential"`` loops (``lax.map``) inside each device's program; the new
  axis of the batched arrays is one more label, so a sharded vmapped axis stays split.

On one device (or inside ``shard_map``, where the program is already per-device) the wrapper
lowers to the plain FFI call.
"""

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.experimental.shard_alike import shard_alike
from jax.sharding import AxisType, ManualAxisType, NamedSharding, PartitionSpec


@dataclass(frozen=True)
class Split:
    """How one FFI call splits over devices (see the module docstring).

    ``operands``, ``results``: the labels of each array's dimensions. ``summed``: per result,
    the labels its value sums over (absent from its own dimensions): the per-device results are
    added up. ``localize(operands, starts)`` and ``finish(results, operands, starts)`` adapt a
    device's slices (``starts``: each split label's first index on this device, traced;
    ``finish`` sees the operands as they came).
    """

    operands: tuple
    results: tuple
    summed: tuple = ()
    localize: Callable | None = None
    finish: Callable | None = None

    def batched(self, label, operands_batched):
        """The split of the call with one more leading axis ``label`` on the batched operands
        and on every result (a vmap axis: its slices are independent calls)."""
        return replace(
            self,
            operands=tuple((label,) + dims if b else dims for dims, b in zip(self.operands, operands_batched)),
            results=tuple((label,) + dims for dims in self.results),
        )

    def labels(self):
        """The labels in order of first appearance (operands first): the order in which they
        get mesh axes when two of them are sharded over the same one."""
        seen = dict.fromkeys(d for dims in self.operands + self.results for d in dims if d is not None)
        return tuple(seen)


def batch_parallel(operand_dims, result_dims):
    """The common split: ``operand_dims``/``result_dims`` as :class:`Split`'s fields."""
    return Split(tuple(map(tuple, operand_dims)), tuple(map(tuple, result_dims)))


# ---- the per-device program ------------------------------------------------------------------


def _run(name, text, method, results, operands, loops):
    """The FFI call on ``operands`` (one device's slices), as the transport emits it; ``loops``:
    for each vmap axis of a loop target (outermost first), which operands it batches."""
    if not loops:
        return list(jax.ffi.ffi_call(name, list(results), vmap_method=method)(*operands, config=text))
    flags, inner = loops[0], loops[1:]
    per_element = [_element_type(r) for r in results]

    def element(mapped):
        mapped = iter(mapped)
        return tuple(
            _run(name, text, method, per_element, [next(mapped) if b else a for a, b in zip(operands, flags)], inner)
        )

    return list(lax.map(element, [a for a, b in zip(operands, flags) if b]))


def _spec_axes(entry):
    """The mesh axes of one entry of a ``PartitionSpec`` (None, a name or a tuple of names)."""
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry) if isinstance(entry, (tuple, list)) else ()


def _assign(split, mesh, shapes, shardings):
    """Each label's mesh axes: those its first sharded dimension (operands, then results) is
    split over, less the axes an earlier label took; a label whose slices would not come out
    even gets none (XLA gathers it)."""
    assignment, taken = {}, set()
    dims = split.operands + split.results
    for label in split.labels():
        for labels, shape, sharding in zip(dims, shapes, shardings):
            if label not in labels or not isinstance(sharding, NamedSharding):
                continue
            axis = labels.index(label)
            spec = tuple(sharding.spec) + (None,) * len(labels)
            axes = tuple(a for a in _spec_axes(spec[axis]) if a not in taken)
            if not axes:
                continue
            if shape[axis] % math.prod(mesh.shape[a] for a in axes) == 0:
                assignment[label] = axes
                taken.update(axes)
            break
    return assignment


def _sharding(mesh, labels, assignment):
    """The ``NamedSharding`` of an array whose dimensions carry ``labels``."""
    entries = []
    for label in labels:
        axes = assignment.get(label, ())
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, PartitionSpec(*entries))


def _mesh_of(shardings):
    """The mesh of the first ``NamedSharding`` among ``shardings`` (None if there is none)."""
    for sharding in shardings:
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _partitioned(name, text, method, split, loops, results):
    """``custom_partitioning`` of the FFI call on the global ``results`` shapes."""

    @custom_partitioning
    def partitioned(*operands):
        return tuple(_run(name, text, method, results, operands, loops))

    def shardings(mesh, arg_shapes, result_shapes):
        shapes = [a.shape for a in arg_shapes] + [r.shape for r in results]
        given = [a.sharding for a in arg_shapes] + list(result_shapes)
        mesh = _mesh_of(given) or mesh
        if mesh is None or mesh.empty:  # no mesh to name axes by: replicate (XLA gathers)
            assignment = {}
            mesh = _device_mesh(given)
        else:
            assignment = _assign(split, mesh, shapes, given)
        operand_shardings = tuple(_sharding(mesh, dims, assignment) for dims in split.operands)
        result_shardings = tuple(_sharding(mesh, dims, assignment) for dims in split.results)
        return mesh, assignment, operand_shardings, result_shardings

    def partition(mesh, arg_shapes, result_shape):
        given = [r.sharding for r in result_shape]
        mesh, assignment, operand_shardings, result_shardings = shardings(mesh, arg_shapes, given)
        local = [jax.ShapeDtypeStruct(s.shard_shape(r.shape), r.dtype) for s, r in zip(result_shardings, results)]

        shared = _shared_text(text, sum(d.process_index == jax.process_index() for d in mesh.devices.flat))

        def per_device(*operands):
            starts = _starts(split, assignment, [a.shape for a in operands], [r.shape for r in local])
            given = list(operands)
            if split.localize is not None:
                operands = split.localize(list(given), starts)
            outputs = _run(name, shared, method, local, operands, loops)
            if split.finish is not None:
                outputs = split.finish(outputs, given, starts)
            for index, summed in enumerate(split.summed):
                axes = tuple(itertools.chain.from_iterable(assignment.get(label, ()) for label in summed))
                if axes:
                    outputs[index] = lax.psum(outputs[index], axes)
            return tuple(outputs)

        return mesh, per_device, result_shardings, operand_shardings

    def infer(mesh, arg_shapes, result_shape):  # the GSPMD partitioner's propagation
        return shardings(mesh, arg_shapes, [None] * len(results))[3]

    partitioned.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=_sdy_rule(split))
    return partitioned


def _shared_text(text, devices):
    """The call's ``config`` for a program that ``devices`` devices of this process run at once
    (their calls share the cores: the handler gives each its share of Numba's threads)."""
    if devices <= 1:
        return text
    return json.dumps(dict(json.loads(text), devices=devices), sort_keys=True, separators=(",", ":"))


def _starts(split, assignment, operand_shapes, result_shapes):
    """Each split label's first index on this device: the device's position along the label's
    mesh axes times the slice's size (any array with that label has it)."""
    starts = {}
    for dims, shape in zip(split.operands + split.results, list(operand_shapes) + list(result_shapes)):
        for label, size in zip(dims, shape):
            if label in assignment and label not in starts:
                starts[label] = lax.axis_index(assignment[label]) * size
    return starts


def _device_mesh(shardings):
    """A one-axis mesh over the devices of the first sharding that names them (everything is
    replicated over it)."""
    for sharding in shardings:
        if sharding is not None:
            return jax.sharding.Mesh(sorted(sharding.device_set, key=lambda d: d.id), ("fastbwd_devices",))
    raise AssertionError("no sharding")


def _sdy_rule(split):
    """The Shardy rule: labels as factors, every whole dimension its own need-replication
    factor."""
    whole = (f"whole{i}" for i in itertools.count())
    replicated = []

    def mapping(dims):
        factors = []
        for label in dims:
            if label is None:
                label = next(whole)
                replicated.append(label)
            factors.append(label)
        return ArrayMapping(*factors)

    operands = tuple(map(mapping, split.operands))
    results = tuple(map(mapping, split.results))
    return SdyShardingRule(operands, results, need_replication_factors=tuple(replicated))


# ---- the call ----------------------------------------------------------------------------------


def _explicit_axes(mesh):
    """The names of ``mesh``'s explicit axes (sharding in types)."""
    if mesh is None or mesh.empty:
        return frozenset()
    return frozenset(a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit)


def _typed(split, operands, results):
    """``results`` with their types: inside ``shard_map`` they vary over the manual axes the
    operands vary over; under a mesh of explicit axes (sharding in types) each label carries
    its operands' sharding to the results, as the partitioning will (a result its caller
    typed keeps its sharding)."""
    types = [jax.typeof(a) for a in operands]
    varying = frozenset().union(*(t.mat.varying for t in types))
    mesh = next((t.sharding.mesh for t in types if _explicit_axes(t.sharding.mesh)), None)
    assignment = {}
    if mesh is not None:
        explicit = _explicit_axes(mesh)
        given = []
        for t in types:
            spec = [tuple(a for a in _spec_axes(entry) if a in explicit) for entry in t.sharding.spec]
            given.append(NamedSharding(mesh, PartitionSpec(*[e or None for e in spec])))
        given += [r.sharding for r in results]
        assignment = _assign(split, mesh, [t.shape for t in types] + [r.shape for r in results], given)
    manual = None
    if varying:  # a manual axis type goes with the (abstract, manual) mesh it names
        manual = ManualAxisType(varying=varying)
        manual_mesh = next(t.sharding.mesh for t in types if t.mat.varying)
    typed = []
    for result, dims in zip(results, split.results):
        sharding = result.sharding
        if sharding is None and mesh is not None:
            sharding = _sharding(mesh, dims, assignment)
        if manual is not None and (sharding is None or sharding.mesh.empty):
            sharding = NamedSharding(manual_mesh, PartitionSpec())
        typed.append(jax.ShapeDtypeStruct(result.shape, result.dtype, sharding=sharding, manual_axis_type=manual))
    return typed


def _element_type(result):
    """``result``'s type without its leading (vmap) axis."""
    sharding = result.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return jax.ShapeDtypeStruct(
        result.shape[1:], result.dtype, sharding=sharding, manual_axis_type=result.manual_axis_type
    )


def _batched_type(result, axis_size):
    """``result``'s type with a leading (vmap) axis."""
    sharding = result.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct(
        (axis_size,) + result.shape, result.dtype, sharding=sharding, manual_axis_type=result.manual_axis_type
    )


def call(name, text, method, split, operands, results, loops=()):
    """The FFI call ``name`` (its ``config`` attribute ``text``) on ``operands``, partitioned by
    ``split``, batched by ``jax.vmap`` as ``method`` (``ffi_call``'s ``vmap_method``) says;
    returns a list of arrays shaped like ``results``."""
    results = _typed(split, operands, results)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and AxisType.Manual in mesh.axis_types:  # in shard_map: every device runs it
        text = _shared_text(text, min(mesh.size, jax.local_device_count()))
    partitioned = _partitioned(name, text, method, split, loops, tuple(results))

    @custom_vmap
    def batchable(*operands):
        return partitioned(*operands)

    @batchable.def_vmap
    def batch(axis_size, in_batched, *operands):
        label = f"vmap{sum(d.startswith('vmap') for d in split.labels())}"
        batched_split, new_loops = split.batched(label, in_batched), loops
        if method == "broadcast_all":  # every operand gets the axis: the handler folds it into N
            operands = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(operands, in_batched)]
            batched_split = split.batched(label, [True] * len(operands))
        elif method == "expand_dims":  # the others get a whole axis of size 1
            operands = [a if b else a[None] for a, b in zip(operands, in_batched)]
            batched_split = replace(
                batched_split,
                operands=tuple(dims if b else (None,) + dims for dims, b in zip(batched_split.operands, in_batched)),
            )
        else:  # a loop over the axis inside each device's program
            new_loops = (tuple(in_batched),) + loops
        batched = [_batched_type(r, axis_size) for r in results]
        outputs = call(name, text, method, batched_split, operands, batched, new_loops)
        return tuple(outputs), (True,) * len(outputs)

    return list(batchable(*operands))


def gradient_like(cotangent, primal):
    """``cotangent`` as the gradient of ``primal`` must be for ``jax.custom_vjp``: inside
    ``shard_map``, summed over the manual axes it varies over and ``primal`` does not (a weight
    the same on every device, used with each device's data: its gradient is the sum of the
    devices', as JAX's transpose of the implicit ``pvary`` makes it for JAX's own operations);
    under a mesh of explicit axes, resharded to ``primal``'s type; elsewhere tied to
    ``primal``'s sharding for XLA's propagation (``shard_alike``)."""
    axes = jax.typeof(cotangent).mat.varying - jax.typeof(primal).mat.varying
    if axes:
        cotangent = lax.psum(cotangent, tuple(sorted(axes)))
    sharding = jax.typeof(primal).sharding
    if _explicit_axes(sharding.mesh):
        return (
            cotangent if jax.typeof(cotangent).sharding == sharding else jax.sharding.reshard(cotangent, sharding.spec)
        )
    return shard_alike(cotangent, primal)[0]


# ---- the operators' splits ---------------------------------------------------------------------


def _plane_dims(rank, layout):
    """``(N, C, H, W)`` (or ``(N, H, W, C)``, or without N at rank 3): batch and channels are
    labels, the plane's axes whole."""
    channels_last = layout == "NHWC"
    plane = (None, None)
    if rank == 3:
        return plane + ("c",) if channels_last else ("c",) + plane
    return ("n",) + plane + ("c",) if channels_last else ("n", "c") + plane


def planes(config, operands, results):
    """The split of upsampling, pooling and padding: one array in, one out, every (n, c) plane
    its own problem, so the batch and the channels split and each plane stays whole (its
    output rows read input rows on both sides)."""
    layout = config.get("layout", "NCHW")
    operand_dims = [_plane_dims(a.ndim, layout) for a in operands]
    result_dims = [_plane_dims(len(r.shape), layout) for r in results]
    return batch_parallel(operand_dims, result_dims)


def samples(config, operands, results):
    """The split of GroupNorm's backward: every sample is normalised on its own, so the batch
    splits (x-shaped arrays and the (N, G) statistics); the channels stay whole (groups span
    them) and the weight and bias gradients, (C,), sum over the batch."""
    rank = operands[0].ndim

    def dims(ndim):
        return ("n",) + (None,) * (ndim - 1) if ndim in (rank, 2) else (None,) * ndim

    return Split(
        tuple(dims(a.ndim) for a in operands),
        tuple(dims(len(r.shape)) for r in results),
        tuple(("n",) if len(r.shape) == 1 else () for r in results),
    )


# RoIAlign: an output row belongs to a box, and the box reads (forward) or scatters into
# (backward) the image its batch index names, which may sit on any device. So the images split
# on their batch and every device sees every box: each device shifts the boxes' image indices
# by its first image (the kernels skip a box whose index is outside their batch) and handles
# the boxes of its own images. The forward's rows of the other boxes are set to -0.0 and the
# rows summed over the devices (x + -0.0 is x, bit for bit, -0.0 and NaN included; a box of no
# image keeps the first device's +0.0): every row has one writer, as in one call. The backward
# needs no collective: each device's gradient rows are its images'. The boxes also split in the
# forward (independent rows); never in the backward, whose scatter would then be summed over
# devices in another order than one call's.


def _image_index(boxes):
    """The boxes' image indices in a type that holds every batch position exactly."""
    return boxes[..., 0].astype(jnp.float64 if boxes.dtype == jnp.float64 else jnp.float32)


def _shift_boxes(operands, starts, position):
    if "n" not in starts:
        return operands
    boxes = operands[position]
    index = _image_index(boxes) - starts["n"].astype(_image_index(boxes).dtype)
    operands[position] = boxes.at[..., 0].set(index.astype(boxes.dtype))
    return operands


def _box_dims(config, operands, results):
    """Labels of RoIAlign's feature maps and pooled rows in the call's layout."""
    del results
    feature = ("n", None, None, "c") if config["layout"] == "NHWC" else ("n", "c", None, None)
    return feature, ("k",) + feature[1:]


def boxes_forward(config, operands, results):
    """The split of RoIAlign's forward ``(input, boxes) -> pooled`` (see above)."""
    feature, pooled = _box_dims(config, operands, results)
    batch = operands[0].shape[0]

    def finish(outputs, operands, starts):
        if "n" not in starts:
            return outputs
        boxes = operands[1]
        index = _image_index(boxes)
        finite = jnp.all(jnp.isfinite(boxes), axis=-1)
        first = starts["n"].astype(index.dtype)
        local = finite & (index >= first) & (index < first + operands[0].shape[-4])
        nowhere = ~(finite & (index >= 0) & (index < batch))
        owned = local | (nowhere & (starts["n"] == 0))
        (pooled_rows,) = outputs
        return [jnp.where(owned[..., None, None, None], pooled_rows, jnp.array(-0.0, pooled_rows.dtype))]

    return Split(
        (feature, ("k", None)),
        (pooled,),
        (("n",),),
        localize=lambda operands, starts: _shift_boxes(operands, starts, 1),
        finish=finish,
    )


def boxes_backward(config, operands, results):
    """The split of RoIAlign's backward ``(grad_output, boxes) -> grad_input`` (see above)."""
    feature, pooled = _box_dims(config, operands, results)
    return Split(
        ((None,) + pooled[1:], (None, None)),
        (feature,),
        localize=lambda operands, starts: _shift_boxes(operands, starts, 1),
    )
