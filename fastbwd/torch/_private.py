"""PyTorch's private interfaces: every one the bridge uses, and only here (docs/design.md,
"fastbwd.torch"). None is touched when ``fastbwd.torch`` is imported: a feature looks its
interfaces up when it is first needed. A PyTorch that lacks one, or whose use of one raises (it
changed), turns that feature off with one warning, never an error, and the bridge takes the
plain path (each feature's description below says which).
"""

import importlib
import sys
import warnings

import torch

EAGER = "the eager shortcut (fastbwd's operators now run through PyTorch's dispatcher, a little slower)"
LAZY = "fused GroupNorms' lazy outputs (a FusedGroupNorm now runs as nn.GroupNorm)"
COMPILER = "the torch.compile hooks (torch.compile keeps PyTorch's own kernels; eager calls still run on fastbwd)"
NOTICE = "enable()'s notice of frames torch.compile compiled while fastbwd was disabled"
ALIASES = "torch._C._nn.silu and silu_ as SiLUs to the fusion (F.silu and nn.SiLU still are)"
DESCRIPTIONS = "the fusion report's skipping of PyTorch's printing code"
PRE_GRAD = (
    "the GroupNorm -> SiLU fusion in the graphs Inductor's pre-grad passes see (with Inductor those pairs stay "
    "PyTorch's; the routed backward operators still run on fastbwd)"
)
JOINT = (
    "the GroupNorm -> SiLU fusion in AOTAutograd's joint graphs (with aot_eager and other backends without "
    "Inductor's passes those pairs stay PyTorch's; the routed backward operators still run on fastbwd)"
)

#: The fake value Dynamo records on each node of a graph it captures, which the pre-grad pass reads.
EXAMPLE_VALUE = "torch.fx.Node.meta['example_value']"
#: The fake value AOTAutograd records on each node of a joint graph (its partitioner reads it): the
#: joint pass reads its arguments' and writes its new nodes'.
VAL = "torch.fx.Node.meta['val']"
#: The fake mode a fake value belongs to, in which the joint pass computes its new nodes' values.
FAKE_MODE = "torch._subclasses.fake_tensor.FakeTensor().fake_mode"

#: The interfaces read from PyTorch's objects while a graph is compiled rather than from a module
#: or a class (a key of a graph node's ``meta``, an attribute every instance gets): path -> the name
#: read. Looking one up finds its owner class; reading it is guarded at each use.
READS = {EXAMPLE_VALUE: "example_value", VAL: "val", FAKE_MODE: "fake_mode"}
_READ_BY = {EXAMPLE_VALUE: PRE_GRAD, VAL: JOINT, FAKE_MODE: JOINT}

_OVERLOADS = "upsample_bilinear2d.vec upsample_bilinear2d.default avg_pool2d.default replication_pad2d.default"

#: Every private interface of PyTorch's that the bridge uses (a dotted path from ``torch``) -> the
#: feature that needs it.
INTERFACES = {
    "torch._C._len_torch_dispatch_stack": EAGER,
    "torch._C._is_torch_function_mode_enabled": EAGER,
    "torch._C._functorch.is_functorch_wrapped_tensor": EAGER,
    "torch._is_functional_tensor": EAGER,
    "torch.Tensor._make_wrapper_subclass": LAZY,
    "torch.Tensor._version": LAZY,
    "torch.autograd.forward_ad._current_level": LAZY,
    "torch._C._AutoDispatchBelowAutograd": COMPILER,
    "torch._C.DispatchKey.Autograd": COMPILER,
    "torch._C.DispatchKey.CompositeImplicitAutograd": COMPILER,
    **{
        f"torch.ops.aten.{name}.{table}": COMPILER
        for name in _OVERLOADS.split()
        for table in ("py_kernels", "_dispatch_cache")
    },
    "torch._decomp.decompositions.upsample_compute_output_size": COMPILER,
    "torch._inductor.config.pre_grad_custom_pass": COMPILER,
    "torch._inductor.custom_graph_pass.CustomGraphPass": COMPILER,
    "torch._inductor.custom_graph_pass.get_hash_for_files": COMPILER,
    "torch._functorch.config.joint_custom_pass": COMPILER,
    "torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER": NOTICE,
    "torch._dynamo.utils.counters": NOTICE,
    "torch._C._nn.silu": ALIASES,
    "torch._C._nn.silu_": ALIASES,
    "torch._tensor_str.__file__": DESCRIPTIONS,
    **_READ_BY,
}

_found = {}  # feature -> {path: (owner, value)}, or None when the feature is off
_warned = set()  # the features that have warned


def _resolve(path):
    """``(owner, value)`` of the last name of ``path``, importing modules along it as needed;
    raises when this PyTorch has no such thing. For an interface of :data:`READS`: ``(the class
    whose instances hold it, the name read)``."""
    if path in READS:
        owner = path.split(".meta[")[0].split("().")[0]
        return _resolve(owner)[1], READS[path]
    parts = path.split(".")
    owner = value = importlib.import_module(parts[0])
    for index, name in enumerate(parts[1:], 2):
        owner = value
        try:
            value = getattr(owner, name)
        except AttributeError:
            value = importlib.import_module(".".join(parts[:index]))
    return owner, value


def _interfaces(feature):
    """``{path: (owner, value)}`` of the interfaces ``feature`` needs, looked up on its first
    call; None (after one warning) when this PyTorch lacks one."""
    found = _found.get(feature, ())
    if found != ():
        return found
    found = {}
    for path, needed_by in INTERFACES.items():
        if needed_by == feature:
            try:
                found[path] = _resolve(path)
            except Exception as error:  # noqa: BLE001 - whatever a lookup raises, the interface is not there
                return broken(feature, f"{path} is missing ({type(error).__name__}: {error})")
    _found[feature] = found
    return found


def broken(feature, what):
    """Turn ``feature`` off for the rest of the process with one warning, and return None. A use
    of an interface that raised calls this (``what`` the error): the interface has changed."""
    if isinstance(what, BaseException):
        what = f"{type(what).__name__}: {what}"
    _found[feature] = None
    if feature not in _warned:
        _warned.add(feature)
        warnings.warn(
            f"fastbwd.torch: this PyTorch ({torch.__version__}) is not what fastbwd knows: {what}. Off from now "
            f"on: {feature}.",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def forget():
    """Look every interface up again at its next use (for tests that take one away)."""
    _found.clear()
    _warned.clear()


# ---- EAGER -------------------------------------------------------------------------------------


#: The tensor types whose calls fastbwd may run without the dispatcher: a tensor subclass (its
#: own ``__torch_function__``) must see the operator, as it sees PyTorch's.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager_tensors(tensors):
    """True when ``tensors`` (None: not given) are plain tensors or parameters and nothing traces
    or transforms the call (no dispatch or function mode: fake tensors, make_fx, AOTAutograd; no
    functorch wrapper, no functional tensor), so an autograd formula may run a kernel directly
    instead of through its operator's dispatcher entry. False when this PyTorch cannot tell."""
    found = _interfaces(EAGER)
    if not found:
        return False
    try:
        if found["torch._C._len_torch_dispatch_stack"][1]() or found["torch._C._is_torch_function_mode_enabled"][1]():
            return False
        wrapped = found["torch._C._functorch.is_functorch_wrapped_tensor"][1]
        functional = found["torch._is_functional_tensor"][1]
        return all(t is None or (type(t) in _PLAIN and not wrapped(t) and not functional(t)) for t in tensors)
    except Exception as error:  # noqa: BLE001
        return broken(EAGER, error) or False


# ---- LAZY --------------------------------------------------------------------------------------


def lazy_outputs():
    """True when a fused GroupNorm may return a lazy output now: the interfaces are there and no
    forward-AD level is open (dual tensors: the fused operator has no forward derivative)."""
    found = _interfaces(LAZY)
    if not found:
        return False
    try:
        return found["torch.autograd.forward_ad._current_level"][0]._current_level < 0
    except Exception as error:  # noqa: BLE001
        return broken(LAZY, error) or False


def forward_ad_open():
    """True when a forward-AD level is open (dual tensors may flow: an autograd.Function without
    a forward derivative must not run), or when this PyTorch cannot tell."""
    found = _interfaces(LAZY)
    if not found:
        return True
    try:
        return found["torch.autograd.forward_ad._current_level"][0]._current_level >= 0
    except Exception as error:  # noqa: BLE001
        return broken(LAZY, error) or True


def wrapper_subclass(cls, *args, **kwargs):
    """``torch.Tensor._make_wrapper_subclass(cls, ...)``: a tensor of ``cls`` with metadata and no
    storage (after :func:`lazy_outputs` said yes)."""
    return _found[LAZY]["torch.Tensor._make_wrapper_subclass"][1](cls, *args, **kwargs)


def versions(input, weight, bias):
    """The version counters of a GroupNorm call's tensors (None for a missing or an inference
    tensor); None when this PyTorch cannot give them."""
    try:
        # three attribute reads on the common path (each pair of a training step makes two calls)
        return input._version, None if weight is None else weight._version, None if bias is None else bias._version
    except RuntimeError:  # an inference tensor has no version counter
        pass
    except Exception as error:  # noqa: BLE001
        return broken(LAZY, error)
    try:
        return tuple(None if t is None or t.is_inference() else t._version for t in (input, weight, bias))
    except Exception as error:  # noqa: BLE001
        return broken(LAZY, error)


# ---- COMPILER (after compiler_available() said yes) ------------------------------------------------


def compiler_available():
    """True when the compiler hooks' interfaces are all there (else one warning)."""
    return bool(_interfaces(COMPILER))


def _compiler(path, owner=False):
    return _found[COMPILER][path][0 if owner else 1]


def below_autograd():
    """A context in which calls record no autograd."""
    return _compiler("torch._C._AutoDispatchBelowAutograd")()


def dispatch_key(name):
    """The dispatch key ``name`` (``Autograd`` or ``CompositeImplicitAutograd``)."""
    return _compiler(f"torch._C.DispatchKey.{name}")


def set_python_kernel(overload, key, kernel):
    """Put ``kernel`` (None: none) at ``key`` of ``overload``'s Python-dispatcher table; returns
    the one that was there (None: none)."""
    previous = overload.py_kernels.pop(key, None)
    if kernel is not None:
        overload.py_kernels[key] = kernel
    overload._dispatch_cache.clear()
    return previous


def upsample_output_size(input_size, output_size, scale_factors):
    return _compiler("torch._decomp.decompositions.upsample_compute_output_size")(
        input_size, output_size, scale_factors
    )


def configs():
    """Inductor's and AOTAutograd's configuration modules (their custom passes)."""
    return _compiler("torch._inductor.config.pre_grad_custom_pass", True), _compiler(
        "torch._functorch.config.joint_custom_pass", True
    )


def custom_graph_pass():
    """``(CustomGraphPass, get_hash_for_files)`` of Inductor."""
    return _compiler("torch._inductor.custom_graph_pass.CustomGraphPass"), _compiler(
        "torch._inductor.custom_graph_pass.get_hash_for_files"
    )


# ---- NOTICE, ALIASES, DESCRIPTIONS -----------------------------------------------------------------


def compiled_graphs():
    """``(graphs, alive)``: how many graphs torch.compile has made in this process, and whether
    frames it compiled are still in use (none since a ``torch.compiler.reset()``); None when
    this PyTorch cannot tell."""
    if "torch._dynamo.convert_frame" not in sys.modules:
        return 0, False  # Dynamo has not run in this process (and importing it takes a while)
    found = _interfaces(NOTICE)
    if not found:
        return None
    try:
        graphs = found["torch._dynamo.utils.counters"][1]["stats"]["unique_graphs"]  # never reset
        frames = found["torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER"][0].FRAME_COMPILE_COUNTER  # reset
        return int(graphs), bool(frames)
    except Exception as error:  # noqa: BLE001
        return broken(NOTICE, error)


def silu_aliases():
    """``{function: works in place}`` of SiLU's private spellings."""
    found = _interfaces(ALIASES)
    return {found["torch._C._nn.silu"][1]: False, found["torch._C._nn.silu_"][1]: True} if found else {}


def printing_files():
    """The source files of PyTorch's tensor printing."""
    found = _interfaces(DESCRIPTIONS)
    return {value for _, value in found.values()} if found else set()


# ---- PRE_GRAD, JOINT: what the graph passes read from the graphs PyTorch's compiler gives them ------


def graph_values(nodes, path):
    """The fake values PyTorch's compiler recorded for graph ``nodes`` under the ``meta`` key
    ``path`` names (:data:`EXAMPLE_VALUE` in a graph Dynamo captured, for the pre-grad pass;
    :data:`VAL` in a joint graph); None (after one warning, that pass's fusion off) when a node
    has none, or one that is not a tensor."""
    feature = _READ_BY[path]
    found = _interfaces(feature)
    if not found:
        return None
    name = found[path][1]
    try:
        values = [node.meta[name] for node in nodes]
    except Exception as error:  # noqa: BLE001 - no such value: the interface changed
        return broken(feature, f"{path} is missing ({type(error).__name__}: {error})")
    for value in values:
        if not isinstance(value, torch.Tensor):
            return broken(feature, f"{path} holds a {type(value).__name__}, not a fake tensor")
    return values


def set_graph_value(node, path, value):
    """Record ``value`` as a new node's fake value under the key ``path`` names (after
    :func:`graph_values` read that key)."""
    node.meta[_found[_READ_BY[path]][path][1]] = value


def fake_mode_of(value):
    """The fake mode of the fake tensor ``value`` (a context manager), or None (after one
    warning, the joint graphs' fusion off)."""
    found = _interfaces(JOINT)
    if not found:
        return None
    try:
        mode = getattr(value, found[FAKE_MODE][1])
    except Exception as error:  # noqa: BLE001
        return broken(JOINT, f"{FAKE_MODE} is missing ({type(error).__name__}: {error})")
    if not (hasattr(mode, "__enter__") and hasattr(mode, "__exit__")):
        return broken(JOINT, f"{FAKE_MODE} is a {type(mode).__name__}, not a mode")
    return mode
