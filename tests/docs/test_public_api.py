"""Every public callable of liftmods is typed and documented.

Walks the callables exported by ``liftmods``, ``liftmods.state``,
``liftmods.compat`` and ``liftmods.core`` (their ``__all__`` where they
have one, else every public name), plus the public methods of
``liftmods.Module``, and checks that each has

* a docstring (a one-line summary);
* for a callable with parameters, a Google-style ``Args:`` section (classes
  may list their fields under ``Attributes:`` instead) naming every
  parameter, which is what the API reference renders;
* an annotation on every parameter.

Re-exports of JAX's own functions (``nn.relu``, ``nn.initializers.zeros``,
...) are exempt: their documentation is JAX's. They are recognised by their
``__module__``.
"""
import dataclasses
import inspect
import re
import types

import pytest

import liftmods
import liftmods.compat
import liftmods.core
import liftmods.state

NAMESPACES = (liftmods, liftmods.state, liftmods.compat, liftmods.core)

# Parameters a callable need not document or annotate, with the reason.
EXEMPT_PARAMS = {
    # Every Module subclass gets these two keyword-only fields from
    # Module; they are documented once, on Module.
    'parent': 'Module field, documented on liftmods.Module',
    'name': 'Module field, documented on liftmods.Module',
}

# Public methods of Module that are checked as callables of their own.
MODULE_METHODS = (
    'setup', 'clone', 'copy', 'param', 'variable', 'has_variable',
    'get_variable', 'put_variable', 'is_mutable_collection', 'has_rng',
    'make_rng', 'is_initializing', 'sow', 'perturb', 'apply',
    'init_with_output', 'init', 'lazy_init', 'module_paths', 'bind',
    'unbind', 'tabulate')

_SECTION = re.compile(r'^(Args|Arguments|Attributes|Parameters):\s*$')


def _names(namespace):
  names = getattr(namespace, '__all__', None)
  if names is None:
    names = [n for n in dir(namespace) if not n.startswith('_')]
  return names


def _is_jax_reexport(obj) -> bool:
  module = getattr(obj, '__module__', None) or ''
  return module == 'jax' or module.startswith(('jax.', 'jaxlib'))


def public_callables():
  """``{qualified name: object}`` of every callable checked here."""
  found = {}
  for namespace in NAMESPACES:
    for name in _names(namespace):
      obj = getattr(namespace, name)
      if isinstance(obj, types.ModuleType) or not callable(obj):
        continue
      if _is_jax_reexport(obj):
        continue
      module = getattr(obj, '__module__', None) or ''
      if not module.startswith('liftmods'):  # e.g. typing aliases
        continue
      found[f'{namespace.__name__}.{name}'] = obj
  for name in MODULE_METHODS:
    found[f'liftmods.Module.{name}'] = getattr(liftmods.Module, name)
  return found


def _doc(obj) -> str:
  doc = inspect.getdoc(obj) or ''
  if inspect.isclass(obj):
    init = obj.__dict__.get('__init__')
    init_doc = getattr(init, '__doc__', None)
    if init_doc and not dataclasses.is_dataclass(obj):
      doc += '\n\n' + inspect.cleandoc(init_doc)
  return doc


def documented_names(doc: str) -> set:
  """Names listed in the ``Args:``/``Attributes:`` sections of ``doc``."""
  names, lines, i = set(), doc.splitlines(), 0
  while i < len(lines):
    if not _SECTION.match(lines[i]):
      i += 1
      continue
    i += 1
    indent = None
    while i < len(lines) and (not lines[i].strip()
                              or lines[i].startswith((' ', '\t'))):
      line = lines[i]
      if line.strip():
        here = len(line) - len(line.lstrip())
        indent = here if indent is None else indent
        if here == indent:
          m = re.match(r'\s*(\*{0,2}[A-Za-z_]\w*)\s*(\(.*?\))?\s*:', line)
          if m:
            names.add(m.group(1).lstrip('*'))
      i += 1
  return names


def has_section(doc: str) -> bool:
  return any(_SECTION.match(line) for line in doc.splitlines())


def parameters(obj):
  """The parameters a caller passes (no self/cls), or None if the
  signature cannot be read."""
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return None
  params = [p for p in sig.parameters.values()
            if p.name not in ('self', 'cls')]
  return [p for p in params if p.name not in EXEMPT_PARAMS
          or not _is_module_class(obj)]


def _is_module_class(obj) -> bool:
  return inspect.isclass(obj) and issubclass(obj, liftmods.Module)


def problems(obj) -> list:
  """What is missing from ``obj``'s types and docs (empty when none)."""
  out = []
  doc = _doc(obj)
  if not doc.strip():
    return ['no docstring']
  params = parameters(obj) or []
  if params:
    if not has_section(doc):
      out.append('no Args:/Attributes: section')
    else:
      listed = documented_names(doc)
      missing = [p.name for p in params if p.name not in listed]
      if missing:
        out.append(f'parameters not documented: {missing}')
  unannotated = [p.name for p in params
                 if p.annotation is inspect.Parameter.empty]
  if unannotated:
    out.append(f'parameters not annotated: {unannotated}')
  return out


CALLABLES = public_callables()


def counts():
  """Counts of the public callables and of those typed and documented."""
  with_params = {k: v for k, v in CALLABLES.items() if parameters(v)}
  annotated = [k for k, v in CALLABLES.items()
               if all(p.annotation is not inspect.Parameter.empty
                      for p in parameters(v) or [])]
  sectioned = [k for k in with_params if has_section(_doc(CALLABLES[k]))]
  clean = [k for k, v in CALLABLES.items() if not problems(v)]
  return {'callables': len(CALLABLES), 'with_params': len(with_params),
          'all_params_annotated': len(annotated),
          'args_section': len(sectioned), 'no_problems': len(clean)}


def test_counts():
  c = counts()
  print(f"{c['callables']} public callables ({c['with_params']} with "
        f"parameters); all parameters annotated: "
        f"{c['all_params_annotated']} "
        f"({c['all_params_annotated'] / c['callables']:.0%}); "
        f"Args/Attributes section: {c['args_section']} of "
        f"{c['with_params']} "
        f"({c['args_section'] / max(c['with_params'], 1):.0%}); "
        f"fully typed and documented: {c['no_problems']}")
  assert c['callables'] >= 150, c


@pytest.mark.parametrize('name', sorted(CALLABLES))
def test_public_callable_is_typed_and_documented(name):
  found = problems(CALLABLES[name])
  assert not found, f'{name}: ' + '; '.join(found)


def test_jax_reexports_are_exempt_only_by_module():
  assert _is_jax_reexport(liftmods.relu)
  assert not _is_jax_reexport(liftmods.Dense)


def test_the_checker_catches_gaps():
  def undocumented(x, y: int):
    """Adds."""
    return x + y

  def documented(x: int, y: int) -> int:
    """Adds.

    Args:
      x: one.
      y (int): the other.
    """
    return x + y

  assert problems(undocumented) == [
      'no Args:/Attributes: section', "parameters not annotated: ['x']"]
  assert problems(documented) == []
