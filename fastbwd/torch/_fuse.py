"""``fuse_group_norm_swish``: GroupNorm -> SiLU pairs of a model run as fastbwd's fused
GroupNorm+Swish (docs/semantics.md §7, docs/design.md "Fusion").

Two mechanisms, neither of which touches a module's own ``forward()``:

* ``nn.Sequential``: a GroupNorm directly followed by an ``nn.SiLU`` becomes a
  :class:`GroupNormSwish` and the SiLU's slot an ``nn.Identity`` (fixed by the structure).
* Every other ``nn.GroupNorm`` becomes a :class:`FusedGroupNorm` (the same object: only its
  class changes). On an eager CPU call its output is a :class:`_LazyGroupNorm`, a tensor that
  holds the input and computes nothing until it is used: a SiLU applied to it first (``F.silu``,
  hence ``nn.SiLU``) runs the fused operator, any other use gets ``F.group_norm``'s exact result.
  Which norms do that ("armed") is decided by watching where their outputs go, in one example
  forward or at their first calls (:func:`_decide`).
"""

import contextlib
import gc
import sys
import warnings
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fastbwd import _dispatch

from . import _ops, _private, _switch
from ._group_norm_swish import GroupNormSwish

# ---- the report -----------------------------------------------------------------------------


class Fused(NamedTuple):
    """A GroupNorm that runs fused with its SiLU: its qualified name and where the SiLU is."""

    name: str
    where: str


class Skipped(NamedTuple):
    """A GroupNorm left as it is, and why."""

    name: str
    reason: str


class FusionReport:
    """What :func:`fuse_group_norm_swish` did to each GroupNorm of the model, in module order:
    ``fused`` (:class:`Fused`), ``skipped`` (:class:`Skipped`) and ``pending`` (names of the
    GroupNorms still deciding, without example inputs). It also behaves as the number of pairs
    fused (``int(report)``, ``report == 3``, ``if report:``).

    A report made without example inputs is live: each access reads the modules' current
    state, so it shows decisions taken at the model's first calls (and a later disarm)."""

    def __init__(self, fused=(), skipped=(), pending=(), *, live=None):
        self._fused, self._skipped, self._pending = tuple(fused), tuple(skipped), tuple(pending)
        self._live = live  # [(name, Fused | Skipped | FusedGroupNorm)], read on every access

    def _entries(self):
        if self._live is None:
            return self._fused, self._skipped, self._pending
        fused, skipped, pending = [], [], []
        for name, entry in self._live:
            if type(entry) is FusedGroupNorm:
                entry._resolve()
            if isinstance(entry, Fused):
                fused.append(entry)
            elif isinstance(entry, Skipped):
                skipped.append(entry)
            elif type(entry) is not FusedGroupNorm:
                skipped.append(Skipped(name, f"no longer a FusedGroupNorm (now {type(entry).__name__})"))
            elif entry.fusion_state == _FUSED:
                fused.append(Fused(name, entry.fusion_where))
            elif entry.fusion_state == _SKIPPED:
                skipped.append(Skipped(name, entry.fusion_reason))
            else:
                pending.append(name)
        return tuple(fused), tuple(skipped), tuple(pending)

    @property
    def fused(self):
        return self._entries()[0]

    @property
    def skipped(self):
        return self._entries()[1]

    @property
    def pending(self):
        return self._entries()[2]

    @property
    def count(self):
        return len(self.fused)

    def __int__(self):
        return self.count

    __index__ = __int__

    def __bool__(self):
        return self.count > 0

    def __eq__(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            return self.count == other
        if isinstance(other, FusionReport):
            return self._entries() == other._entries()
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        fused, skipped, pending = self._entries()
        return f"FusionReport(fused={list(fused)!r}, skipped={list(skipped)!r}, pending={list(pending)!r})"

    def __str__(self):
        fused, skipped, pending = self._entries()
        head = f"fused {len(fused)} GroupNorm + SiLU pair(s), skipped {len(skipped)} GroupNorm(s)"
        if pending:
            head += f", {len(pending)} pending (decided at their first calls)"
        lines = [head]
        lines += [f"  fused   {f.name}: {f.where}" for f in fused]
        lines += [f"  skipped {s.name}: {s.reason}" for s in skipped]
        lines += [f"  pending {name}: decides at its first eager calls" for name in pending]
        return "\n".join(lines)


# ---- the entry point ------------------------------------------------------------------------


def fuse_group_norm_swish(module: nn.Module, example_inputs=None, example_kwargs=None) -> FusionReport:
    """Run every ``nn.GroupNorm`` of ``module`` whose output goes only into a SiLU as fastbwd's
    fused GroupNorm+Swish (forward and backward), however the model's ``forward()`` methods are
    written; nothing else changes behaviour.

    * In an ``nn.Sequential`` (recursively), a GroupNorm directly followed by an ``nn.SiLU``
      becomes a :class:`GroupNormSwish` (the same Parameter objects) and the SiLU's slot an
      ``nn.Identity``.
    * Every other GroupNorm (exactly ``nn.GroupNorm``, not a subclass) becomes a
      :class:`FusedGroupNorm`: the same module object, parameters, hooks and state_dict keys,
      whose eager CPU calls return an output that runs fused if a SiLU (``nn.SiLU`` or
      ``F.silu``, not a subclass of ``nn.SiLU``) is its first and only use, and exactly as
      ``nn.GroupNorm`` otherwise. Which of them are armed is decided by watching where their
      outputs go:

      - ``example_inputs`` (a tuple of positional arguments of ``module``'s forward; a single
        tensor is taken as a 1-tuple) and/or ``example_kwargs`` (a dict of keyword arguments):
        one forward runs now, under ``torch.no_grad()``, with the RNG state forked and every
        buffer restored afterwards. A GroupNorm each of whose calls fed exactly one use, a
        SiLU, is armed; the others become plain ``nn.GroupNorm`` again, and the report says why.
      - neither: each GroupNorm decides by itself. Its first eager call observes (exact
        ``nn.GroupNorm`` results) and its next call decides from what the previous calls'
        outputs went to (an output still referenced at that point is not fused). The report
        is live and lists those not yet decided as ``pending``.

      Armed norms stay safe when a forward takes a path not seen while deciding: an output
      whose first use is not a SiLU is computed exactly (that call is not fused); an output
      used again after its SiLU gets its exact value there, with a one-time warning, and that
      GroupNorm is not fused from then on.

    Calling it again re-decides (with example inputs, from a new example forward). Returns a
    :class:`FusionReport` listing every GroupNorm of ``module``: fused (and where its SiLU is),
    skipped (and why) or pending.
    """
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    observe = example_inputs is not None or example_kwargs is not None
    undo = []
    static = {}
    _fuse_sequentials(module, static, undo)
    names = _names(module)
    candidates = []
    for sub in _unique_modules(module):
        name = names[id(sub)]
        if isinstance(sub, GroupNormSwish):
            static.setdefault(name, Fused(name, "already a GroupNormSwish (GroupNorm and Swish in one module)"))
        elif type(sub) in (nn.GroupNorm, FusedGroupNorm):
            refusal = _refusal(sub)
            if refusal:
                _restore(sub)
                static[name] = Skipped(name, refusal)
            else:
                _arm_candidate(sub, name, not observe, names)
                candidates.append(sub)
        elif isinstance(sub, nn.GroupNorm):
            static[name] = Skipped(
                name, f"a subclass of nn.GroupNorm ({type(sub).__qualname__}): its forward may differ"
            )
    if observe:
        try:
            output, returned = _observe(module, example_inputs or (), example_kwargs or {})
        except BaseException:
            for sub in candidates:
                _restore(sub)
            for undo_one in reversed(undo):
                undo_one()
            raise
        if any(_kept(sub, returned) for sub in candidates):
            gc.collect()  # an output held only by a reference cycle is not kept
        for sub in candidates:
            state, text = _decide(sub, final=True, returned=returned)
            if state == _FUSED:
                sub._settle(state, text)
            else:
                _restore(sub)
                static[names[id(sub)]] = Skipped(names[id(sub)], text)
        del output  # kept until here: the outputs it holds were returned, not dropped
    entries = []
    for sub in _unique_modules(module):
        name = names[id(sub)]
        if name in static:
            entries.append((name, static.pop(name)))
        elif type(sub) is FusedGroupNorm:
            entries.append((name, sub))
    entries += list(static.items())  # replaced modules (a Sequential's GroupNorm) by their old names
    order = {name: index for index, name in enumerate(_all_names(module))}
    entries.sort(key=lambda entry: order.get(entry[0], len(order)))
    return FusionReport(live=entries)


def _names(module):
    """``{id(submodule): qualified name}`` (the first name of a module registered under
    several), ``module`` itself named ``(the model)``."""
    names = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        names.setdefault(id(sub), name or "(the model)")
    return names


def _all_names(module):
    return [name or "(the model)" for name, _ in module.named_modules(remove_duplicate=False)]


def _unique_modules(module):
    return [sub for _, sub in module.named_modules()]


def _refusal(norm):
    """Why fastbwd's fused kernels cannot stand in for ``norm`` whatever its input, or None."""
    return _ops.settings_refusal(norm.num_channels, norm.num_groups, norm.eps)


# ---- nn.Sequential --------------------------------------------------------------------------


def _fuse_sequentials(module, fused, undo):
    for prefix, sequential in module.named_modules():
        if not isinstance(sequential, nn.Sequential):
            continue
        slots = _slots(sequential)
        for first, second in zip(slots, slots[1:]):
            norm, following = getattr(sequential, first), getattr(sequential, second)
            if type(norm) in (nn.GroupNorm, FusedGroupNorm) and type(following) is nn.SiLU and not _refusal(norm):
                _restore(norm)
                # nn.Module.__setattr__ puts a module in its slot: the order of the modules stays
                setattr(sequential, first, _group_norm_swish(norm))
                setattr(sequential, second, nn.Identity())
                name = f"{prefix}.{first}" if prefix else first
                fused[name] = Fused(name, f"nn.Sequential {prefix or '(the model)'}: followed by nn.SiLU")

                def put_back(sequential=sequential, first=first, second=second, norm=norm, silu=following):
                    setattr(sequential, first, norm)
                    setattr(sequential, second, silu)

                undo.append(put_back)


def _slots(sequential):
    """The names of ``sequential``'s modules in the order it runs them, a module held twice under
    each of its names (``named_children`` names it once)."""
    return [name for name, _ in sequential.named_modules(remove_duplicate=False) if name and "." not in name]


def _group_norm_swish(norm):
    """A GroupNormSwish on ``norm``'s Parameter objects (or None), settings and mode."""
    fused = GroupNormSwish(norm.num_groups, norm.num_channels, norm.eps, affine=False)
    fused.affine = norm.affine
    fused.weight, fused.bias = norm.weight, norm.bias
    fused.train(norm.training)
    return fused


# ---- FusedGroupNorm -------------------------------------------------------------------------

_PENDING, _OBSERVING, _FUSED, _SKIPPED = "pending", "observing", "fused", "skipped"
_dynamo, _threads = torch.compiler.is_dynamo_compiling, torch.get_num_threads
_FUSED_FLOOR = _ops.FLOOR_KEYS["fused"]
_floors = _dispatch.floors_of(*_FUSED_FLOOR)


class FusedGroupNorm(nn.GroupNorm):
    """An ``nn.GroupNorm`` that runs as fastbwd's fused GroupNorm+Swish when its output goes
    into a SiLU (made by :func:`fuse_group_norm_swish`, which changes a GroupNorm's class to
    this one; parameters, buffers and state_dict are nn.GroupNorm's).

    ``fusion_state`` is ``"fused"`` (armed), ``"skipped"`` (``fusion_reason`` says why: it is
    then nn.GroupNorm), or, while deciding without example inputs, ``"pending"`` or
    ``"observing"``. On an eager CPU call an armed module returns an output that computes on
    its first use: ``F.silu``/``nn.SiLU`` -> fastbwd's fused operator, anything else ->
    ``F.group_norm``'s result. Under ``torch.compile``, tracing, scripting, autocast, tensor
    subclasses or dispatch modes, and on other devices, it is ``nn.GroupNorm``.
    """

    fusion_state = _SKIPPED
    fusion_reason = "not prepared by fuse_group_norm_swish"
    fusion_where = ""
    fusion_name = ""
    _fusion_live = False
    _fusion_records = ()
    _fusion_warned = False
    _fusion_ineligible = None
    _fusion_names = {}

    def forward(self, input):
        if torch.jit.is_scripting():
            return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
        # An armed norm's call PyTorch runs faster by its size alone (_ops.below_floor, written
        # out: the call costs a declined training step 1.5 us); Dynamo goes on to F.group_norm.
        if self.fusion_state == _FUSED and not _dynamo() and type(input) is torch.Tensor and _switch._policy == "auto":
            threads = _threads()
            least = _floors.get(threads)
            if input.numel() < (_dispatch.floor(*_FUSED_FLOOR, threads) if least is None else least):
                return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
        return self._fused_forward(input)

    @torch.jit.unused
    def _fused_forward(self, input):
        # is_compiling first: torch.compile folds it and captures plain F.group_norm, whose
        # pairs its own graph pass can fuse
        state = self.fusion_state
        if torch.compiler.is_compiling() or state == _SKIPPED:
            return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
        weight, bias = self.weight, self.bias  # read once (nn.Module.__getattr__ is Python)
        geometry = self._geometry(input, weight, bias)
        if geometry is None:
            if state == _OBSERVING:
                self._fusion_ineligible = self._ineligible(input)
            return F.group_norm(input, self.num_groups, weight, bias, self.eps)
        if state == _FUSED:
            if not geometry.serves("fused"):  # PyTorch's own pair is the faster (fastbwd._dispatch)
                return F.group_norm(input, self.num_groups, weight, bias, self.eps)
            return _LazyGroupNorm(input, self, weight, bias, geometry, None)
        if self._resolve():
            return self._fused_forward(input)
        self.fusion_state = _OBSERVING
        record = _Record()
        self._fusion_records.append(record)
        lazy = _LazyGroupNorm(input, self, weight, bias, geometry, record)
        record.output = weakref.ref(lazy)
        return lazy

    def _resolve(self):
        """Without example inputs: take the decision the calls observed so far allow (at the
        next call, or when a report is read); True when taken."""
        if not (self._fusion_live and self.fusion_state == _OBSERVING and self._fusion_records):
            return False
        state, text = _decide(self, final=False)
        if state is not None:
            self._settle(state, text)
        return state is not None

    def _geometry(self, input, weight, bias):
        """The call's GroupNorm+Swish geometry when fastbwd runs it exactly as nn.GroupNorm would
        (a plain eager CPU call fastbwd's kernels take, ``_ops.refusal``), else None (the call
        is nn.GroupNorm's)."""
        if not _ops.use_eager_path(input, weight, bias) or not input.is_cpu or not _private.lazy_outputs():
            return None
        return _ops.geometry_of(input, weight, bias, self.num_groups, self.eps, 1.0)

    def _ineligible(self, input):
        """Why a call is not one the fused path takes (for the report)."""
        if not isinstance(input, torch.Tensor):
            return f"its calls are traced or transformed ({type(input).__name__} input), not eager"
        reason = _ops.refusal(input, self.num_groups, self.weight, self.bias, self.eps)
        return reason or "its calls are not plain eager CPU calls fastbwd fuses (tracing, autocast or a tensor mode)"

    def _settle(self, state, text):
        self._fusion_records = []
        self.fusion_state = state
        if state == _FUSED:
            self.fusion_where = text
        else:
            self.fusion_reason = text

    def _disarm(self, reason):
        """Not fused from now on; warns once."""
        self._settle(_SKIPPED, reason)
        if not self._fusion_warned:
            self._fusion_warned = True
            # the warning points at the code that used the output
            frame, level, plumbing = sys._getframe(), 1, _plumbing()
            while frame is not None and frame.f_code.co_filename in plumbing:
                frame, level = frame.f_back, level + 1
            warnings.warn(
                f"fastbwd.torch: the output of the fused GroupNorm {self.fusion_name!r} was used again after "
                "its SiLU (a path not seen when it was fused): that SiLU's result came from fastbwd's fused "
                "kernel, the other use got nn.GroupNorm's exact output. This GroupNorm is not fused from now on.",
                UserWarning,
                stacklevel=level,
            )

    def extra_repr(self):
        state = self.fusion_state
        if state == _FUSED:
            what = "fused: runs as fastbwd's GroupNorm+Swish with the SiLU applied to its output"
        elif state == _SKIPPED:
            what = f"not fused ({self.fusion_reason})"
        else:
            what = "fusion pending: decided from where its first calls' outputs go"
        return f"{super().extra_repr()}, {what}"

    def __getstate__(self):
        # what is being observed (weak references) belongs to this process's calls
        state = super().__getstate__()
        state["_fusion_records"] = []
        state["_fusion_names"] = {}
        if state.get("fusion_state") == _OBSERVING:
            state["fusion_state"] = _PENDING
        return state


def _arm_candidate(norm, name, live, names):
    """Make ``norm`` a FusedGroupNorm that observes its next calls (``live``: and decides by
    itself at a later call); ``names`` (``{id(module): qualified name}``) describe its uses."""
    _restore(norm)
    norm.__class__ = FusedGroupNorm
    norm.fusion_name, norm._fusion_names, norm._fusion_live, norm._fusion_records = name, names, live, []
    norm.fusion_state = _PENDING if live else _OBSERVING


def _restore(norm):
    """``norm`` a plain nn.GroupNorm again (a no-op for one)."""
    if type(norm) is FusedGroupNorm:
        for attribute in [name for name in norm.__dict__ if name.startswith(("fusion_", "_fusion_"))]:
            del norm.__dict__[attribute]  # the class's defaults
        norm.__class__ = nn.GroupNorm


# ---- observing and deciding -----------------------------------------------------------------


class _Record:
    """Where one observed call's output went: its uses in order (:class:`_Use`), until an
    in-place SiLU (after which the tensor holds the SiLU's output)."""

    __slots__ = ("uses", "closed", "output")

    def __init__(self):
        self.uses = []
        self.closed = False
        self.output = None  # a weak reference to the call's _LazyGroupNorm


def _decide(norm, final, returned=frozenset()):
    """``(state, text)`` from ``norm``'s observed calls: ``(_FUSED, where the SiLU is)`` when
    every call's output had exactly one use and it was a SiLU, ``(_SKIPPED, why not)``, or
    ``(None, None)`` while that cannot be known yet (not ``final``, and no call seen yet).

    ``final`` (after the example forward): every output should be gone, but those in
    ``returned`` (ids of the outputs the forward returned). Otherwise (at a later call of the
    GroupNorm): an earlier call's output that is still referenced outlives its call (kept, or
    the GroupNorm called again before that output was used), and is not fused."""
    records = norm._fusion_records
    for record in records:
        if record.uses and not record.uses[0].silu:
            return _SKIPPED, f"its output goes to {record.uses[0].what} before any SiLU"
        if len(record.uses) > 1:
            return _SKIPPED, f"its output is used {len(record.uses)} times ({'; '.join(u.what for u in record.uses)})"
    alive = [record.output() for record in records if record.output() is not None]
    if alive:
        if any(id(output) in returned for output in alive):
            return _SKIPPED, "its output is returned from the model's forward unconsumed"
        return _SKIPPED, "its output is still referenced after the call that made it (kept, or returned)"
    if not records:
        if not final:
            return None, None
        if norm._fusion_ineligible:
            return _SKIPPED, norm._fusion_ineligible
        return _SKIPPED, "not called in the example forward"
    if any(not record.uses for record in records):
        return _SKIPPED, "its output is not used"
    return _FUSED, records[0].uses[0].what


def _kept(norm, returned):
    """Whether an output of ``norm``'s observed calls is still referenced, and not returned."""
    return any(
        output is not None and id(output) not in returned for output in (r.output() for r in norm._fusion_records)
    )


def _observe(module, args, kwargs):
    """One forward of ``module`` under ``torch.no_grad()``, the RNG state forked and every
    buffer (BatchNorm statistics, counters) put back afterwards; returns its output and the ids
    of the lazy outputs in it."""
    saved = [
        (owner, name, buffer, buffer.detach().clone())
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False, remove_duplicate=False)
    ]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            output = module(*args, **kwargs)
        return output, frozenset(id(t) for t in _tensors_in(output) if type(t) is _LazyGroupNorm)
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in saved:
                setattr(owner, name, buffer)  # the buffer itself again, if the forward assigned another
                buffer.copy_(value)


def _tensors_in(value, depth=0):
    """The tensors in a forward's output (tuples, lists, dicts, objects' attributes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        items = vars(value).values()
    else:
        return []
    return [t for item in items for t in _tensors_in(item, depth + 1)]


# ---- the lazy output ------------------------------------------------------------------------

#: Functions that read a tensor's metadata, which a lazy output answers without computing.
_METADATA = {
    getattr(torch.Tensor, name)
    for name in "size stride dim ndimension numel nelement is_contiguous element_size is_floating_point is_complex "
    "is_signed get_device storage_offset __len__".split()
} | {torch.numel, torch.is_floating_point, torch.is_complex}
_METADATA |= {
    getattr(torch.Tensor, name).__get__
    for name in "shape ndim dtype device layout requires_grad is_cpu is_cuda is_sparse is_quantized is_meta is_mkldnn "
    "is_nested itemsize nbytes".split()
    if hasattr(torch.Tensor, name)
}


def _plumbing():
    """The source files of the frames between a use of a lazy output and the code using it."""
    if not _PLUMBING:
        torch_files = {torch.overrides.__file__, F.__file__, sys.modules[torch.Tensor.__module__].__file__}
        _PLUMBING.update(torch_files, _private.printing_files(), {__file__})
    return _PLUMBING


_PLUMBING = set()


class _LazyGroupNorm(torch.Tensor):
    """``F.group_norm(input, ...)`` of a :class:`FusedGroupNorm` call, computed when first used.

    A wrapper tensor (``_make_wrapper_subclass``: the real result's metadata, no storage).
    Metadata reads answer from it; ``F.silu`` as its first use runs the fused operator (armed),
    anything else gets the exact ``F.group_norm`` result (made once, then reused). When
    observing, the result is made at once and every use is recorded."""

    @staticmethod
    def __new__(cls, input, norm, weight, bias, geometry, record):
        grad = torch.is_grad_enabled()
        if record is None:
            result, strides = None, geometry.output_strides
        else:
            result = F.group_norm(input, norm.num_groups, weight, bias, norm.eps)
            strides = result.stride()
        requires_grad = grad and (
            input.requires_grad
            or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad)
        )
        self = _private.wrapper_subclass(
            cls, input.shape, strides=strides, dtype=input.dtype, device=input.device, requires_grad=requires_grad
        )
        self._fb_input, self._fb_weight, self._fb_bias = input, weight, bias
        self._fb_norm, self._fb_geometry, self._fb_record = norm, geometry, record
        self._fb_grad, self._fb_inference = grad, torch.is_inference_mode_enabled()
        self._fb_versions = None if record is not None else _private.versions(input, weight, bias)
        self._fb_result = result  # F.group_norm's tensor once made (or, after an in-place SiLU, its output)
        self._fb_consumed = False  # an armed output whose SiLU ran fused
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # the SiLU first: the use every armed output expects
        inplace = _ops.silu_functions().get(func)
        if inplace is not None and args and type(args[0]) is cls:
            lazy = args[0]
            inplace = inplace or bool(kwargs.get("inplace", args[1] if len(args) > 1 else False))
            if lazy._fb_record is None and lazy._fb_result is None and not lazy._fb_consumed:
                if not _is_silu_subclass(_owner(_user_frame())):
                    return lazy._fused_silu(inplace)
            return _call(func, args, kwargs, inplace)
        if func in _METADATA and type(args[0]) is cls:
            lazy = args[0]
            if lazy._fb_result is None:
                return super().__torch_function__(func, types, args, kwargs)
            return func(lazy._fb_result, *args[1:], **kwargs)
        return _call(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"fastbwd.torch: {func} reached the output of a fused GroupNorm below __torch_function__, "
            "where it would have to compute without knowing its use. This is a fastbwd bug: please "
            "report it. Until fixed, leave that GroupNorm unfused (fuse with example_inputs, or do not "
            "fuse the model)."
        )

    def _fused_silu(self, inplace):
        """The first use is a SiLU: fastbwd's fused operator on the call's input."""
        self._check_unmodified()
        input = self._fb_input
        with _grad_mode(self._fb_grad and torch.is_grad_enabled()):
            if _ops._eager():  # no mode entered since the GroupNorm's call (which checked its tensors)
                y = _ops.EagerGroupNormSwish.apply(input, self._fb_weight, self._fb_bias, self._fb_geometry)
            else:  # a mode entered between the GroupNorm and its SiLU: through the operator
                norm = self._fb_norm
                y = torch.ops.fastbwd.group_norm_swish(
                    input, self._fb_weight, self._fb_bias, norm.num_groups, float(norm.eps), 1.0
                )[0]
        self._fb_consumed = True
        if inplace:
            self._fb_result = y  # what the tensor now holds: later uses see the SiLU's output
        return y

    def _materialise(self, func, silu_inplace):
        """The tensor an operation other than a first SiLU gets: F.group_norm's result (made
        once), recording the use when observing (``silu_inplace``: None unless ``func`` is a
        SiLU, then whether it works in place)."""
        record = self._fb_record
        if record is not None:
            if not record.closed:
                use = _use(func, silu_inplace is not None, self._fb_norm._fusion_names)
                record.uses.append(use)
                record.closed = use.silu and silu_inplace  # the tensor now holds the SiLU's output
            return self._fb_result
        if self._fb_result is None:
            if self._fb_consumed:
                self._fb_norm._disarm(
                    "its output was used again after its SiLU at run time (a path not seen when it was fused)"
                )
            self._check_unmodified()
            norm = self._fb_norm
            with _creation_modes(self):
                self._fb_result = F.group_norm(
                    self._fb_input, norm.num_groups, self._fb_weight, self._fb_bias, norm.eps
                )
        return self._fb_result

    def _check_unmodified(self):
        versions = self._fb_versions and _private.versions(self._fb_input, self._fb_weight, self._fb_bias)
        if versions and versions != self._fb_versions:
            raise RuntimeError(
                f"fastbwd.torch: the input or parameters of the fused GroupNorm {self._fb_norm.fusion_name!r} were "
                "modified in place between its call and the first use of its output, which the fused GroupNorm "
                "computes at that use. Fuse this model with example inputs (the GroupNorm is then left unfused) "
                "or do not modify them in place before using the output."
            )


def _call(func, args, kwargs, silu_inplace=None):
    """``func`` on the real tensors behind every lazy output among its arguments."""

    def real(value):
        return value._materialise(func, silu_inplace) if type(value) is _LazyGroupNorm else value

    return func(*_map(real, args), **_map(real, kwargs))


def _map(function, value):
    """``value`` with ``function`` applied to every leaf in its tuples, lists and dicts."""
    if isinstance(value, (tuple, list)):
        items = [_map(function, item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _map(function, item) for key, item in value.items()}
    return function(value)


class _Use(NamedTuple):
    silu: bool  # a SiLU: nn.SiLU itself, or F.silu called outside an nn.SiLU subclass
    what: str  # for the report


def _use(func, is_silu, names):
    """The :class:`_Use` of an observed output by ``func``, described with the module names
    ``names`` (``{id(module): qualified name}``)."""
    owner, site = _site()
    where = site
    if owner is not None:
        where = f"{names[id(owner)]} ({site})" if id(owner) in names else site
    if is_silu:
        if type(owner) is nn.SiLU:
            return _Use(True, f"nn.SiLU {names.get(id(owner), '(unnamed)')}")
        if _is_silu_subclass(owner):
            return _Use(False, f"{type(owner).__qualname__}, a subclass of nn.SiLU (not fused), {where}")
        return _Use(True, f"F.silu in {where}")
    name = torch.overrides.resolve_name(func) or getattr(func, "__qualname__", repr(func))
    name = name.replace("torch.nn.functional.", "F.").replace("torch.Tensor.", "Tensor.")
    return _Use(False, f"{name} in {where}")


def _site():
    """``(module or None, description)`` of the code that is using a lazy output (see
    :func:`_user_frame` and :func:`_owner`)."""
    frame = _user_frame()
    if frame is None:
        return None, "?"
    owner = _owner(frame)
    if owner is not None:
        return owner, f"{type(owner).__qualname__}.forward"
    return None, getattr(frame.f_code, "co_qualname", frame.f_code.co_name)


def _user_frame():
    """The frame of the code that is using a lazy output: the first one outside fastbwd's and
    PyTorch's dispatch plumbing (None if there is none)."""
    frame, plumbing = sys._getframe(1), _plumbing()
    while frame is not None and frame.f_code.co_filename in plumbing:
        frame = frame.f_back
    return frame


def _owner(frame):
    """The module whose ``forward(self, ...)`` ``frame`` runs, or None."""
    code = frame.f_code if frame is not None else None
    if code is not None and code.co_name == "forward" and code.co_argcount and code.co_varnames[0] == "self":
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            return owner
    return None


def _is_silu_subclass(owner):
    return isinstance(owner, nn.SiLU) and type(owner) is not nn.SiLU


class _grad_mode:  # noqa: N801 - used as a context manager, like torch.no_grad
    """``torch.set_grad_enabled(enabled)`` only when it changes something (it costs a few
    microseconds otherwise)."""

    __slots__ = ("enabled", "previous")

    def __init__(self, enabled):
        self.enabled = enabled

    def __enter__(self):
        self.previous = torch.is_grad_enabled()
        if self.previous != self.enabled:
            torch.set_grad_enabled(self.enabled)

    def __exit__(self, *exc):
        if self.previous != self.enabled:
            torch.set_grad_enabled(self.previous)


def _creation_modes(lazy):
    """The grad and inference modes of the GroupNorm call, for computing its output later."""
    if torch.is_inference_mode_enabled() == lazy._fb_inference:
        return _grad_mode(lazy._fb_grad)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(lazy._fb_inference))
    stack.enter_context(_grad_mode(lazy._fb_grad))
    return stack
