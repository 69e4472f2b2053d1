"""A linear map whose transpose is fastbwd's: how every fastbwd.jax function gets its derivatives.

Each function is a ``jax.custom_jvp`` whose JVP rule computes the primal result (XLA or fastbwd's
forward) and the tangent by :func:`call`: a primitive that is linear in its ``linear`` operands,

* evaluated (forward mode: ``jax.jvp``, ``jax.jacfwd``) by ``apply``, plain JAX (the operator
  itself on the tangent, or the JVP of its jax.numpy reference);
* transposed (reverse mode: ``jax.grad``, ``jax.vjp``) by ``transpose``, the fastbwd backward
  through the FFI: the same primitive with the two swapped, so that a gradient through a linear
  operator has its own derivatives (``jax.jvp`` or ``jax.grad`` of ``jax.grad``);
* batched (``jax.vmap``) by vmapping both, the cotangents of unbatched operands summed over the
  batch, as the transpose of a broadcast is.

The function the primitive evaluates is a parameter held as a closed jaxpr, not a Python
function: JAX looks inside a parameter's jaxprs when it lowers a program, so a partitioned FFI
call there (_sharding's ``custom_partitioning``) gets the program's devices and the shardings
it names, as it does anywhere else in the program.

``jax.custom_vjp`` gives reverse mode only; JAX's own ``linear_call`` has no batching rule. The
transpose is a Python function parameter: a program using the primitive is not serialisable by
``jax.export``.
"""

import functools

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad, batching, mlir

_linear_p = core.Primitive("fastbwd_linear")
_linear_p.multiple_results = True


def _split(args, residual_count):
    return list(args[:residual_count]), list(args[residual_count:])


def _traced(function, residuals, linear):
    """``function(residuals, linear)`` as a closed jaxpr of the flat operands (residuals, then
    linear), the arrays' full types (sharding, varying manual axes) kept."""
    residual_count = len(residuals)

    def flat(*args):
        return list(function(*_split(args, residual_count)))

    return jax.make_jaxpr(flat)(*residuals, *linear)


def _function(jaxpr, residual_count):
    """A closed jaxpr of the flat operands as ``function(residuals, linear)``."""

    def function(residuals, linear):
        return core.jaxpr_as_fun(jaxpr)(*residuals, *linear)

    return function


def call(name, apply, transpose, residuals, linear):
    """``apply(residuals, linear)`` (a list of arrays, linear in ``linear``) as the primitive
    whose transpose is ``transpose(residuals, cotangents)`` (a list, one per ``linear``);
    ``name``: the fastbwd.jax function's, for the error differentiating a kernel raises."""
    residuals, linear = list(residuals), list(linear)
    return _linear_p.bind(
        *residuals,
        *linear,
        apply=_traced(apply, residuals, linear),
        transpose=without_derivative(transpose, name),
        residual_count=len(residuals),
    )


def without_derivative(function, name):
    """``function`` (of arrays and lists of arrays), whose own derivative raises an error naming
    ``name``: fastbwd's kernels (the backward, and a forward the rule computes residuals with)
    have none, and JAX would say only that an FFI call, or its partitioning, cannot be
    differentiated."""

    @jax.custom_jvp
    def undifferentiable(*args):
        return function(*args)

    @undifferentiable.defjvp
    def undifferentiable_jvp(primals, tangents):
        raise TypeError(
            f"fastbwd.jax.{name}: fastbwd's kernels are not differentiable: a derivative of its "
            "gradient that moves the point the gradient is taken at (jax.jvp or jax.grad of "
            "jax.grad, a Hessian) is not supported here; forward mode (jax.jvp, jax.jacfwd) and "
            "reverse mode are"
        )

    return undifferentiable


def _impl(*args, apply, transpose, residual_count):
    return core.jaxpr_as_fun(apply)(*args)


def _abstract_eval(*args, apply, transpose, residual_count):
    return apply.out_avals


def _jvp(primals, tangents, *, apply, transpose, residual_count):
    params = dict(apply=apply, transpose=transpose, residual_count=residual_count)
    outputs = _linear_p.bind(*primals, **params)
    residuals, linear = _split(primals, residual_count)
    residual_tangents, linear_tangents = _split(tangents, residual_count)
    linear_tangents = [ad.instantiate_zeros(t) for t in linear_tangents]
    if all(type(t) is ad.Zero for t in residual_tangents):
        tangents_out = _linear_p.bind(*residuals, *linear_tangents, **params)
    else:  # a residual moves too: the function is differentiated as it is
        residual_tangents = [ad.instantiate_zeros(t) for t in residual_tangents]
        tangents_out = jax.jvp(core.jaxpr_as_fun(apply), tuple(primals), (*residual_tangents, *linear_tangents))[1]
    return outputs, tangents_out


def _transpose(cotangents, *args, apply, transpose, residual_count):
    residuals, linear = _split(args, residual_count)
    if any(ad.is_undefined_primal(r) for r in residuals):  # pragma: no cover - residuals are never linear
        raise NotImplementedError("fastbwd.jax: a residual of a linear map was differentiated")
    cotangents = [ad.instantiate_zeros(c) for c in cotangents]
    # the transpose, as the same primitive whose own transpose is the function evaluated here
    results = _linear_p.bind(
        *residuals,
        *cotangents,
        apply=_traced(transpose, residuals, cotangents),
        transpose=_function(apply, residual_count),
        residual_count=residual_count,
    )
    return [None] * residual_count + [r if ad.is_undefined_primal(x) else None for r, x in zip(results, linear)]


def _batch(args, dims, *, apply, transpose, residual_count):
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    mapped = [None if d is None else 0 for d in dims]
    residual_axes, linear_axes = _split(mapped, residual_count)

    def batched_apply(residuals, linear):
        return jax.vmap(_function(apply, residual_count), in_axes=(residual_axes, linear_axes))(residuals, linear)

    def batched_transpose(residuals, cotangents):
        results = jax.vmap(transpose, in_axes=(residual_axes, [0] * len(cotangents)))(residuals, cotangents)
        # an operand the batch does not map receives the sum of every element's cotangent
        return [r if axis == 0 else jnp.sum(r, axis=0) for r, axis in zip(results, linear_axes)]

    residuals, linear = _split(args, residual_count)
    outputs = _linear_p.bind(
        *args,
        apply=_traced(batched_apply, residuals, linear),
        transpose=batched_transpose,
        residual_count=residual_count,
    )
    return outputs, [0] * len(outputs)


_linear_p.def_impl(_impl)
_linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[_linear_p] = _jvp
ad.primitive_transposes[_linear_p] = _transpose
batching.primitive_batchers[_linear_p] = _batch
mlir.register_lowering(_linear_p, mlir.lower_fun(_impl, multiple_results=True))


def linear_function(name, forward, backward):
    """``f(x, static) = forward(x, *static)``, a map linear in ``x`` (``static``: a hashable tuple
    of its other arguments) whose transpose is ``backward(cotangent, *static)``: its own
    derivative, in both directions, under every transformation (``name``: the fastbwd.jax
    function's)."""

    @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
    def function(x, static):
        return forward(x, *static)

    @function.defjvp
    def function_jvp(static, primals, tangents):
        (x,), (tangent,) = primals, tangents

        def apply(residuals, linear):
            return [forward(linear[0], *static)]

        def transpose(residuals, cotangents):
            return [backward(cotangents[0], *static)]

        # the primal through the function itself, so that differentiating the gradient again
        # (jax.jvp of jax.grad) finds this rule rather than an FFI call (a pooling's forward)
        return function(x, static), call(name, apply, transpose, [], [tangent])[0]

    return function
