"""A linear map whose transpose is fastbwd's: how every fastbwd.jax function gets its derivatives.

Each function is a ``jax.custom_jvp`` whose JVP rule computes the primal result (XLA or fastbwd's
forward) and the tangent by :func:`call`: a primitive that is linear in its ``linear`` operands,

* evaluated (forward mode: ``jax.jvp``, ``jax.jacfwd``) by ``apply``, plain JAX (the operator
  itself on the tangent, or the JVP of its jax.numpy reference);
* transposed (reverse mode: ``jax.grad``, ``jax.vjp``) by ``transpose``, the fastbwd backward
  through the FFI, itself a linear map of this kind whose transpose is ``apply`` (so the
  gradient's own forward-mode derivative, ``jax.jvp`` of ``jax.grad``, works for the linear
  operators);
* batched (``jax.vmap``) by vmapping both, the cotangents of unbatched operands summed over the
  batch, as the transpose of a broadcast is.

``jax.custom_vjp`` gives reverse mode only; JAX's own ``linear_call`` has no batching rule. A
primitive carries Python callables as parameters: a program using it is not serialisable by
``jax.export``.
"""

import functools

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend import core
from jax.interpreters import ad, batching, mlir

_linear_p = core.Primitive("fastbwd_linear")
_linear_p.multiple_results = True


def call(apply, transpose, residuals, linear):
    """``apply(residuals, linear)`` (a list of arrays, linear in ``linear``) as the primitive
    whose transpose is ``transpose(residuals, cotangents)`` (a list, one per ``linear``)."""
    residuals, linear = list(residuals), list(linear)
    shapes = jax.eval_shape(apply, residuals, linear)
    avals = tuple(ShapedArray(shape.shape, shape.dtype) for shape in shapes)
    return _linear_p.bind(
        *residuals, *linear, apply=apply, transpose=transpose, residual_count=len(residuals), avals=avals
    )


def _split(args, residual_count):
    return list(args[:residual_count]), list(args[residual_count:])


def _impl(*args, apply, transpose, residual_count, avals):
    return apply(*_split(args, residual_count))


def _abstract_eval(*args, apply, transpose, residual_count, avals):
    return avals


def _jvp(primals, tangents, *, apply, transpose, residual_count, avals):
    outputs = _linear_p.bind(*primals, apply=apply, transpose=transpose, residual_count=residual_count, avals=avals)
    residuals, linear = _split(primals, residual_count)
    residual_tangents, linear_tangents = _split(tangents, residual_count)
    linear_tangents = [ad.instantiate_zeros(t) for t in linear_tangents]
    if all(type(t) is ad.Zero for t in residual_tangents):
        tangents_out = _linear_p.bind(
            *residuals, *linear_tangents, apply=apply, transpose=transpose, residual_count=residual_count, avals=avals
        )
    else:  # a residual moves too: apply is plain JAX, differentiated as it is
        residual_tangents = [ad.instantiate_zeros(t) for t in residual_tangents]
        tangents_out = jax.jvp(apply, (residuals, linear), (residual_tangents, linear_tangents))[1]
    return outputs, tangents_out


def _transpose(cotangents, *args, apply, transpose, residual_count, avals):
    residuals, linear = _split(args, residual_count)
    if any(ad.is_undefined_primal(r) for r in residuals):  # pragma: no cover - residuals are never linear
        raise NotImplementedError("fastbwd.jax: a residual of a linear map was differentiated")
    cotangents = [jnp.zeros(a.shape, a.dtype) if type(c) is ad.Zero else c for c, a in zip(cotangents, avals)]
    linear_avals = tuple(
        ShapedArray(x.aval.shape, x.aval.dtype) if ad.is_undefined_primal(x) else jax.typeof(x) for x in linear
    )
    results = _linear_p.bind(
        *residuals, *cotangents, apply=transpose, transpose=apply, residual_count=residual_count, avals=linear_avals
    )
    return [None] * residual_count + [r if ad.is_undefined_primal(x) else None for r, x in zip(results, linear)]


def _batch(args, dims, *, apply, transpose, residual_count, avals):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    mapped = [None if d is None else 0 for d in dims]
    residual_axes, linear_axes = _split(mapped, residual_count)

    def batched_apply(residuals, linear):
        return jax.vmap(apply, in_axes=(residual_axes, linear_axes))(residuals, linear)

    def batched_transpose(residuals, cotangents):
        results = jax.vmap(transpose, in_axes=(residual_axes, [0] * len(cotangents)))(residuals, cotangents)
        # an operand the batch does not map receives the sum of every element's cotangent
        return [r if axis == 0 else jnp.sum(r, axis=0) for r, axis in zip(results, linear_axes)]

    batched_avals = tuple(ShapedArray((size,) + a.shape, a.dtype) for a in avals)
    outputs = _linear_p.bind(
        *args, apply=batched_apply, transpose=batched_transpose, residual_count=residual_count, avals=batched_avals
    )
    return outputs, [0] * len(outputs)


_linear_p.def_impl(_impl)
_linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[_linear_p] = _jvp
ad.primitive_transposes[_linear_p] = _transpose
batching.primitive_batchers[_linear_p] = _batch
mlir.register_lowering(_linear_p, mlir.lower_fun(_impl, multiple_results=True))


def linear_function(forward, backward):
    """``f(x, static) = forward(x, *static)``, a map linear in ``x`` (``static``: a hashable tuple
    of its other arguments) whose transpose is ``backward(cotangent, *static)``: its own
    derivative, in both directions, under every transformation."""

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
        # (jax.jvp of jax.grad) finds this rule rather than an FFI call
        return function(x, static), call(apply, transpose, [], [tangent])[0]

    return function
