"""Differentiation of scope functions: ``vjp``, ``value_and_grad``, ``jvp``
and ``custom_vjp``, each a short function over ``pack``. The variables of
the ``vjp_variables``/``grad_vars`` collections are differentiated along
with the arguments; gradients for them come back shaped like the scope
tree.
"""
import functools
from collections.abc import Sequence
from typing import Any, Callable

import jax

from liftmods.core.pack import pack
from liftmods.core.scope import Scope


def _bwd_with_tree(treedef, bwd, cotangent):
  var_grads, *input_grads = bwd(cotangent)
  return (treedef.unflatten(var_grads), *input_grads)


def _scope_treedef(scope):
  return jax.tree_util.tree_structure(
      scope, is_leaf=lambda x: isinstance(x, Scope))


def vjp(fn: Callable[..., Any], scope: Any, *primals: Any,
        has_aux: bool = False, reduce_axes: Sequence[str] = (),
        vjp_variables: Any = 'params', variables: Any = True,
        rngs: Any = True) -> tuple[Any, ...]:
  """``jax.vjp`` of ``fn(scope, *primals)``, also with respect to variables.

  Args:
    fn: ``fn(scope, *primals)``.
    scope: the scope (or scopes) ``fn`` runs on.
    *primals: the arguments to differentiate with respect to.
    has_aux: ``fn`` returns ``(y, aux)``.
    reduce_axes: not supported; must be empty.
    vjp_variables: the collections to differentiate with respect to.
    variables: the other collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.

  Returns:
    ``(y, vjp_fn)`` (``(y, vjp_fn, aux)`` with ``has_aux``);
      ``vjp_fn(cotangent)`` returns ``(variable_grads, *primal_grads)`` where
      ``variable_grads`` has the structure of ``scope``.

  Raises:
    NotImplementedError: ``reduce_axes`` is given.
  """
  if reduce_axes:
    raise NotImplementedError('vjp: reduce_axes is no longer supported.')

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args):
    vjp_vars, other_vars = variable_groups

    @functools.wraps(fn)
    def pure(vjp_vars, *args):
      inner_scope = make_scopes((vjp_vars, other_vars), rng_groups)
      if has_aux:
        y, aux = fn(inner_scope, *args)
      else:
        y, aux = fn(inner_scope, *args), ()
      return y, (aux, repack_fn(inner_scope))

    y, bwd, (aux, out_vars) = jax.vjp(pure, vjp_vars, *args, has_aux=True)
    bwd = jax.tree_util.Partial(
        functools.partial(_bwd_with_tree, _scope_treedef(scope)), bwd)
    if has_aux:
      return (y, bwd, aux), out_vars
    return (y, bwd), out_vars

  return pack(inner, (vjp_variables, variables), (variables,), (rngs,),
              name='vjp')(scope, *primals)


def value_and_grad(fn: Callable[..., Any], scope, *primals,
                   has_aux: bool = False, reduce_axes=(), variables=True,
                   rngs=True):
  """Value of the scalar ``fn(scope, *primals)`` and its gradient with
  respect to the primals (not the variables). Returns ``(y, grads)`` or
  ``(y, aux, grads)`` with ``has_aux``."""
  if reduce_axes:
    raise NotImplementedError(
        'value_and_grad: reduce_axes is no longer supported.')

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args):
    @functools.wraps(fn)
    def pure(*args):
      inner_scope = make_scopes(variable_groups, rng_groups)
      if has_aux:
        y, aux = fn(inner_scope, *args)
      else:
        y, aux = fn(inner_scope, *args), ()
      return y, (aux, repack_fn(inner_scope))

    y, bwd, (aux, out_vars) = jax.vjp(pure, *args, has_aux=True)
    grads = bwd(jax.numpy.ones_like(y))
    if has_aux:
      return (y, aux, grads), out_vars
    return (y, grads), out_vars

  return pack(inner, (variables,), (variables,), (rngs,),
              name='value_and_grad')(scope, *primals)


def jvp(fn: Callable[..., Any], scope: Any, primals: Sequence[Any],
        tangents: Sequence[Any], variable_tangents: Any,
        variables: Any = True, rngs: Any = True) -> tuple[Any, Any]:
  """``jax.jvp`` of ``fn(scope, *primals)``, with tangents for variables too.

  Args:
    fn: ``fn(scope, *primals)``.
    scope: the scope (or scopes) ``fn`` runs on.
    primals: the arguments, a tuple.
    tangents: their tangents.
    variable_tangents: ``{collection: tangents}`` per scope (collections
      left out have zero tangent).
    variables: the collections ``fn`` sees.
    rngs: the rng sequences ``fn`` sees.

  Returns:
    ``(y, y_tangent)``.
  """
  treedef = _scope_treedef(scope)
  variable_tangents = tuple(
      {col: t for col, t in per_scope.items() if t}
      for per_scope in treedef.flatten_up_to(variable_tangents))
  target = tuple(variable_tangents[0].keys()) if variable_tangents else ()

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args):
    jvp_vars, other_vars = variable_groups

    @functools.wraps(fn)
    def pure(jvp_vars, args):
      inner_scope = make_scopes((jvp_vars, other_vars), rng_groups)
      y = fn(inner_scope, *args)
      return y, repack_fn(inner_scope)

    (y, out_vars), (y_tangent, _) = jax.jvp(
        pure, (jvp_vars, args), (variable_tangents, tangents))
    return (y, y_tangent), out_vars

  return pack(inner, (target, variables), (variables,), (rngs,),
              name='jvp')(scope, *primals)


def custom_vjp(fn: Callable[..., Any], forward_fn: Callable[..., Any],
               backward_fn: Callable[..., Any], grad_vars: Any = 'params',
               nondiff_argnums: Sequence[int] = ()) -> Callable[..., Any]:
  """``jax.custom_vjp`` for scope functions.

  Args:
    fn: ``fn(scope, *args) -> y``, the primal computation.
    forward_fn: ``forward_fn(scope, *args) -> (y, residuals)``, run when a
      gradient is taken.
    backward_fn: ``backward_fn(*nondiff_args, residuals, y_cotangent)``
      returning ``(variable_cotangents, *arg_cotangents)``, the first shaped
      like the ``grad_vars`` collections of the scope(s).
    grad_vars: the collections that get cotangents.
    nondiff_argnums: arguments that are not differentiated (the scope is 0).

  Returns:
    ``f(scope, *args)`` with the custom gradient.
  """

  def inner(make_scopes, repack_fn, variable_groups, rng_groups, *args):
    grad_variables, other_variables = variable_groups
    treedef_box = []

    def primal(grad_variables, *args):
      inner_scope = make_scopes((grad_variables, other_variables), rng_groups)
      y = fn(inner_scope, *args)
      return y, repack_fn(inner_scope)

    def forward(grad_variables, *args):
      scopes = make_scopes((grad_variables, other_variables), rng_groups)
      treedef_box.append(_scope_treedef(scopes))
      y, residuals = forward_fn(scopes, *args)
      return (y, repack_fn(scopes)), residuals

    def backward(*args):
      nondiff, (residuals, (y_cotangent, _)) = args[:-2], args[-2:]
      var_cotangents, *arg_cotangents = backward_fn(*nondiff, residuals,
                                                    y_cotangent)
      var_cotangents = tuple(treedef_box[-1].flatten_up_to(var_cotangents))
      return (var_cotangents, *arg_cotangents)

    wrapped = jax.custom_vjp(primal, nondiff_argnums=nondiff_argnums)
    wrapped.defvjp(forward, backward)
    return wrapped(grad_variables, *args)

  return pack(inner, (grad_vars, True), (grad_vars, True), (True,),
              name='custom_vjp')
