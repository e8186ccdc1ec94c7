"""Stand-ins for TensorFlow, TensorBoard and TensorFlow Datasets.

AQT's Flax example (``aqt.jax.v2.examples.flax_e2e_model``) imports
``flax.metrics.tensorboard`` (TensorFlow) and ``tensorflow_datasets`` at
module level, though its tests and the differential tests never write a
summary or load MNIST. Installing these stand-ins lets such modules import
without TensorFlow; any use of them raises.

As a pytest plugin: ``PYTHONPATH=tools python -m pytest -p no_tensorflow ...``.
"""
import sys
import types

_NAMES = ('tensorflow', 'tensorboard', 'tensorboard.plugins',
          'tensorboard.plugins.hparams', 'tensorboard.plugins.hparams.api',
          'tensorflow_datasets')


class _Unavailable:
  """Any attribute is another stand-in; calling one raises."""

  def __init__(self, name):
    self._name = name

  def __getattr__(self, attr):
    return _Unavailable(f'{self._name}.{attr}')

  def __call__(self, *args, **kwargs):
    raise RuntimeError(f'{self._name} is a stand-in (tools/no_tensorflow.py): '
                       'install TensorFlow to use it.')


def _module(name):
  module = types.ModuleType(name, 'stand-in (tools/no_tensorflow.py)')
  module.__path__ = []
  module.__getattr__ = lambda attr: _Unavailable(f'{name}.{attr}')
  return module


def install():
  """Puts the stand-ins in ``sys.modules`` where the real ones are absent."""
  try:  # flax.io picks its file backend by looking for TensorFlow: first
    import flax.io  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    pass
  for name in _NAMES:
    if name not in sys.modules:
      try:
        __import__(name)
      except ImportError:
        sys.modules[name] = _module(name)
  for name in _NAMES[1:5]:
    parent, _, child = name.rpartition('.')
    if parent and isinstance(sys.modules[name], types.ModuleType):
      setattr(sys.modules[parent], child, sys.modules[name])


def pytest_configure(config):  # pylint: disable=unused-argument
  install()
