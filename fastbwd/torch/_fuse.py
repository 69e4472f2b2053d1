"""``fuse_group_norm_swish``: GroupNorm + SiLU pairs of a model become one :class:`GroupNormSwish`
(docs/semantics.md §7), in ``nn.Sequential`` containers and inside submodules' ``forward()``.

A submodule whose ``forward()`` calls a GroupNorm it owns is traced with ``torch.fx`` (its
children as leaves, so only its own code is read), once per training flag and per pattern of
``None`` among its optional arguments; where the GroupNorm's output goes only into a SiLU (an
``nn.SiLU`` module or ``F.silu``), the SiLU is dropped from the graph and the GroupNorm replaced
by a GroupNormSwish holding the same Parameter objects under the same name. The submodule keeps
its class, attributes and state_dict keys; only its instance gets a new ``forward``, generated
from the rewritten graphs, which picks the graph matching each call.
"""

import copy
import inspect
import itertools
from typing import NamedTuple

import torch
from torch import fx, nn

from ._group_norm_swish import GroupNormSwish

#: Optional arguments (default None) a traced forward() may have: each doubles the traces.
MAX_OPTIONAL_ARGUMENTS = 3
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class Fused(NamedTuple):
    """A GroupNorm that became a GroupNormSwish: its qualified name and where its SiLU was."""

    name: str
    where: str


class Skipped(NamedTuple):
    """A GroupNorm left as it is, and why."""

    name: str
    reason: str


class FusionReport:
    """What :func:`fuse_group_norm_swish` did: ``fused`` and ``skipped`` (tuples of
    :class:`Fused` and :class:`Skipped`, in module order). It also behaves as the number of
    pairs fused (``int(report)``, ``report == 3``, ``if report:``), which is what the function
    returned before it reported."""

    def __init__(self, fused, skipped):
        self.fused = tuple(fused)
        self.skipped = tuple(skipped)

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
            return (self.fused, self.skipped) == (other.fused, other.skipped)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"FusionReport(fused={list(self.fused)!r}, skipped={list(self.skipped)!r})"

    def __str__(self):
        lines = [f"fused {self.count} GroupNorm + SiLU pair(s), skipped {len(self.skipped)} GroupNorm(s)"]
        lines += [f"  fused   {f.name}: {f.where}" for f in self.fused]
        lines += [f"  skipped {s.name}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def fuse_group_norm_swish(module: nn.Module) -> FusionReport:
    """Fuse every ``nn.GroupNorm`` of ``module`` whose output goes only into a SiLU.

    Two places are searched (``module`` included, recursively):

    * ``nn.Sequential`` containers: a GroupNorm directly followed by an ``nn.SiLU`` becomes a
      :class:`GroupNormSwish` and the SiLU's slot an ``nn.Identity`` (indices and state_dict keys
      do not move);
    * the ``forward()`` of any other submodule that owns a GroupNorm (directly or through an
      ``nn.ModuleList``/``nn.ModuleDict``), traced with ``torch.fx``: where each call of the
      GroupNorm feeds only an ``nn.SiLU`` (for example ``self.nonlinearity``) or ``F.silu``, the
      GroupNorm is replaced by a GroupNormSwish under the same name and the SiLU call removed
      from a forward generated for that instance. A forward that cannot be traced (control flow
      on tensor values or shapes, ``*args``) or that assigns the module's attributes (which a
      graph would drop) is left as it is.

    Fused modules hold the same Parameter objects (an optimizer built before keeps working) and
    state_dict keys do not change, so checkpoints load either way. A rewritten ``forward()`` is
    specialised to the module's attribute values at fusion time (except its training flag and
    which optional arguments are None, all of whose cases are traced): fuse a configured model.
    A model with a rewritten forward can be deep-copied, and saved and loaded by its state_dict,
    but not pickled whole (``torch.save(model)`` raises).

    Returns a :class:`FusionReport`: which GroupNorms were fused and which were skipped, and
    why. It compares equal to, and converts to, the number fused.
    """
    fused, skipped = {}, {}
    _fuse_sequentials(module, fused, skipped)
    names = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        names.setdefault(id(sub), []).append(name)
    for owner_name, owner in list(module.named_modules()):
        if isinstance(owner, (nn.Sequential, GroupNormSwish) + _CONTAINERS) or type(owner) is nn.GroupNorm:
            continue
        norms = _owned_norms(owner)
        if norms:
            _fuse_in_forward(owner, owner_name, norms, names, fused, skipped)
    order = [name for name, _ in module.named_modules(remove_duplicate=False)]
    for name, sub in module.named_modules():
        if type(sub) is nn.GroupNorm and name not in fused and name not in skipped:
            skipped[name] = "not called by its owner's forward() (nor in an nn.Sequential)"
    rank = {name: index for index, name in enumerate(order)}
    return FusionReport(
        sorted((Fused(n, w) for n, w in fused.items()), key=lambda f: rank.get(f.name, 0)),
        sorted((Skipped(n, r) for n, r in skipped.items()), key=lambda s: rank.get(s.name, 0)),
    )


def _qualified(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def _fused(norm):
    """A GroupNormSwish on ``norm``'s Parameter objects (or None), settings and mode."""
    fused = GroupNormSwish(norm.num_groups, norm.num_channels, norm.eps, affine=False)
    fused.affine = norm.affine
    fused.weight, fused.bias = norm.weight, norm.bias
    fused.train(norm.training)
    return fused


# ---- nn.Sequential ---------------------------------------------------------------------------


def _fuse_sequentials(module, fused, skipped):
    for prefix, sequential in module.named_modules():
        if not isinstance(sequential, nn.Sequential):
            continue
        names = list(sequential._modules)
        for index, first in enumerate(names):
            norm = sequential._modules[first]
            if type(norm) is not nn.GroupNorm:
                continue
            name = _qualified(prefix, first)
            following = sequential._modules[names[index + 1]] if index + 1 < len(names) else None
            if type(following) is nn.SiLU:
                sequential._modules[first] = _fused(norm)
                sequential._modules[names[index + 1]] = nn.Identity()
                fused[name] = f"nn.Sequential {prefix or '(the model)'}: followed by nn.SiLU"
            else:
                what = "last in" if following is None else f"followed by {type(following).__name__} in"
                skipped[name] = f"{what} nn.Sequential {prefix or '(the model)'}"


# ---- forward() via torch.fx ------------------------------------------------------------------


def _owned_norms(owner):
    """``{target: GroupNorm}``: the GroupNorms ``owner`` holds directly or inside
    ModuleList/ModuleDict children, by their path from ``owner`` (as fx names call targets)."""
    found = {}

    def visit(module, prefix):
        for name, child in module._modules.items():
            if child is None:
                continue
            path = _qualified(prefix, name)
            if type(child) is nn.GroupNorm:
                found[path] = child
            elif isinstance(child, _CONTAINERS):
                visit(child, path)

    visit(owner, "")
    return found


class _LeafTracer(fx.Tracer):
    """Traces one module's own forward(): every submodule call stays a call."""

    def is_leaf_module(self, module, qualified_name):
        return True


def _is_silu(node, modules):
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.SiLU
    return node.op == "call_function" and node.target is torch.nn.functional.silu


def _first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _fuse_in_forward(owner, owner_name, norms, names, fused, skipped):
    """Trace ``owner.forward`` in every case, fuse the GroupNorms that feed only a SiLU in all of
    them, and give ``owner`` a forward generated from the rewritten graphs."""
    label = f"{type(owner).__name__}.forward() of {owner_name or '(the model)'}"
    qualified = {target: _qualified(owner_name, target) for target in norms}

    def skip_all(reason):
        for target in norms:
            skipped.setdefault(qualified[target], reason)

    if "forward" in owner.__dict__:
        return skip_all(f"{label} is overridden on the instance (already rewritten, or patched)")
    signature = inspect.signature(type(owner).forward)
    parameters = list(signature.parameters.values())[1:]  # without self
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return skip_all(f"{label} takes *args or **kwargs (not traced)")
    optional = [p.name for p in parameters if p.default is None]
    if len(optional) > MAX_OPTIONAL_ARGUMENTS:
        return skip_all(f"{label} has more than {MAX_OPTIONAL_ARGUMENTS} arguments that default to None")

    cases = list(itertools.product((True, False), itertools.product((False, True), repeat=len(optional))))
    graphs = {}
    training = owner.training
    try:
        for mode, nones in cases:
            owner.training = mode  # the owner's flag only: its children are not run while tracing
            state = _state(owner)
            concrete = {name: None for name, none in zip(optional, nones) if none}
            try:
                graphs[mode, nones] = _LeafTracer().trace(owner, concrete_args=concrete)
            finally:
                changed = _changed(owner, state)
                if changed:
                    _restore(owner, state)
            if changed:  # forward() rebinds attributes (a cache, a counter): a graph would drop that
                return skip_all(f"{label} assigns attributes of the module, which a traced graph would drop")
    except Exception as error:  # noqa: BLE001 - anything fx cannot trace: leave the module as it is
        return skip_all(f"{label} cannot be traced ({_first_line(error)})")
    finally:
        owner.training = training

    modules = dict(owner.named_modules())
    fusable = {}
    for target, norm in norms.items():
        if len(names[id(norm)]) > 1:
            skipped[qualified[target]] = f"the same GroupNorm is registered under several names: {names[id(norm)]}"
            continue
        calls = [
            node
            for graph in graphs.values()
            for node in graph.nodes
            if node.op == "call_module" and node.target == target
        ]
        if not calls:
            skipped[qualified[target]] = f"not called by {label}"
            continue
        reason = None
        for node in calls:
            users = list(node.users)
            if len(users) != 1:
                reason = f"its output is used {len(users)} times in {label}"
            elif not _is_silu(users[0], modules):
                reason = f"its output goes to {_describe(users[0], modules)} in {label}, not a SiLU"
            elif users[0].args[:1] != (node,) or any(node in _flat(a) for a in users[0].args[1:]):
                reason = f"its output is not the only input of the SiLU in {label}"
            if reason:
                break
        if reason:
            skipped[qualified[target]] = reason
        else:
            fusable[target] = calls
    if not fusable:
        return None

    where = {}
    for target, calls in fusable.items():
        for node in calls:
            silu = next(iter(node.users))
            where[target] = f"{label}: {_describe(silu, modules)}"
            silu.replace_all_uses_with(node)
            silu.graph.erase_node(silu)
    functions = {}
    sources = {}
    for key, graph in graphs.items():
        graph.lint()
        code = graph.python_code(root_module="self")
        if code.src not in sources:  # cases that trace alike share one function
            namespace = dict(code.globals)
            exec(compile(code.src, f"<fastbwd fused {type(owner).__name__}.forward>", "exec"), namespace)
            sources[code.src] = namespace["forward"]
        functions[key] = sources[code.src]
    for target in fusable:
        _replace(owner, target, _fused(norms[target]))
        fused[qualified[target]] = where[target]
    owner.forward = _FusedForward(owner, _dispatcher(signature, optional, functions))
    return None


def _tables(module):
    return (module.__dict__, module._parameters, module._buffers, module._modules)


def _state(module):
    """Shallow copies of what an attribute assignment in forward() can change: the module's own
    attributes, parameters, buffers and children."""
    return tuple(dict(table) for table in _tables(module))


def _changed(module, state):
    return any(
        table.keys() != saved.keys() or any(table[name] is not saved[name] for name in saved)
        for table, saved in zip(_tables(module), state)
    )


def _restore(module, state):
    """Undo assignments made while tracing (their values may hold fx proxies)."""
    for table, saved in zip(_tables(module), state):
        table.clear()
        table.update(saved)


def _flat(value):
    if isinstance(value, (tuple, list)):
        return [item for element in value for item in _flat(element)]
    if isinstance(value, dict):
        return _flat(list(value.values()))
    return [value]


def _describe(node, modules):
    if node.op == "call_module":
        return f"self.{node.target} ({type(modules.get(node.target)).__name__})"
    if node.op == "call_function":
        if node.target is torch.nn.functional.silu:
            return "F.silu"
        return getattr(node.target, "__qualname__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    return node.op


def _replace(owner, target, module):
    *path, last = target.split(".")
    parent = owner
    for name in path:
        parent = parent._modules[name]
    parent._modules[last] = module


def _dispatcher(signature, optional, functions):
    """``call(module, *args, **kwargs)``: the traced function for the module's training flag and
    which optional arguments are None, called with every argument in signature order."""
    bind = signature.bind
    arity = len(signature.parameters) - 1

    def call(module, *args, **kwargs):
        if not optional and not kwargs and len(args) == arity:  # all positional: no binding
            return functions[module.training, ()](module, *args)
        bound = bind(module, *args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())[1:]
        nones = tuple(bound.arguments[name] is None for name in optional)
        return functions[module.training, nones](module, *values)

    return call


class _FusedForward:
    """The forward of a module rewritten by :func:`fuse_group_norm_swish`, set on the instance.

    Deep-copies with its module; refuses to be pickled (the generated code is not importable,
    and restoring the class's own forward over the fused modules would apply Swish twice)."""

    __slots__ = ("module", "call")

    def __init__(self, module, call):
        self.module = module
        self.call = call

    def __call__(self, *args, **kwargs):
        return self.call(self.module, *args, **kwargs)

    def __deepcopy__(self, memo):
        return _FusedForward(copy.deepcopy(self.module, memo), self.call)

    def __reduce__(self):
        raise TypeError(
            f"{type(self.module).__name__} has a forward() rewritten by fuse_group_norm_swish and "
            "cannot be pickled whole: save and load its state_dict instead"
        )
