"""One side of the keras differential test, run in its own process.

``python -m tests.compat.keras_side {flax,liftmods} OUT.npz [CASE ...]``
wraps Linen modules in keras 3's ``keras.layers.FlaxLayer`` (JAX backend)
and saves every array it compares. With ``liftmods`` the switch is installed
before keras is imported; ``FlaxLayer`` imports ``flax.core.scope`` (flax's
own under the switch) and passes ``mutable=DenyList(['params'])`` to
``apply``.

Cases (the parts each saves are listed in ``PARTS``):

- ``cnn``: a CNN with BatchNorm and Dropout whose ``__call__`` takes
  ``training``: the weights keras initialises, ``predict`` (inference mode),
  a call in training mode (dropout on, batch statistics updated), then
  ``fit`` for two epochs (its loss history and the weights after), and
  ``predict`` again;
- ``method``: ``FlaxLayer(module, method=...)`` on a module method other
  than ``__call__`` (no ``training`` argument) and a function taking the
  module first, each with variables given to the layer (``variables=``,
  from ``init``): ``predict``, and ``fit`` on one of them.
"""
import os
import sys

import numpy as np

from tests.compat.differential import flat, run_side

X = np.random.RandomState(0).rand(16, 8, 8, 3).astype(np.float32)
Y = np.random.RandomState(1).randint(0, 4, size=(16,))
V = np.random.RandomState(2).randn(16, 6).astype(np.float32)


def _before_import():
  os.environ['KERAS_BACKEND'] = 'jax'


def _weights(prefix, model, out):
  flat(prefix, {w.path: np.asarray(w.value) for w in model.weights}, out)


def _cnn_module():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class CNN(nn.Module):

    @nn.compact
    def __call__(self, x, training=False):
      x = nn.Conv(8, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not training, momentum=0.5)(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
      x = nn.Dropout(0.25, deterministic=not training)(x)
      return nn.Dense(4)(x)

  return CNN()


def _cnn(out):
  import keras  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8, 8, 3))
  model = keras.Model(inputs, keras.layers.FlaxLayer(_cnn_module())(inputs))
  _weights('cnn/init', model, out)
  flat('cnn/predict', model.predict(X, batch_size=8, verbose=0), out)
  flat('cnn/training_call', np.asarray(model(X[:4], training=True)), out)
  _weights('cnn/after_training_call', model, out)
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  history = model.fit(X, Y, epochs=2, batch_size=8, shuffle=False, verbose=0)
  flat('cnn/fit_loss', np.asarray(history.history['loss']), out)
  _weights('cnn/fit', model, out)
  flat('cnn/predict_after_fit', model.predict(X, batch_size=8, verbose=0),
       out)


def _encoder():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Encoder(nn.Module):

    def setup(self):
      self.hidden = nn.Dense(5)
      self.out = nn.Dense(3)

    def __call__(self, x):
      return self.out(self.encode(x))

    def encode(self, x):
      return nn.tanh(self.hidden(x))

  return Encoder()


def _method(out):
  import jax  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  module = _encoder()
  variables = module.init(jax.random.key(3), V[:1])
  flat('method/variables', variables, out)

  def doubled(mdl, x):
    return 2 * mdl(x)

  models = {}
  for name, method in (('encode', type(module).encode), ('function', doubled)):
    inputs = keras.Input((6,))
    layer = keras.layers.FlaxLayer(module, method=method, variables=variables)
    models[name] = keras.Model(inputs, layer(inputs))
    flat(f'method/predict_{name}', models[name].predict(V, verbose=0), out)
  model = models['function']
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse')
  history = model.fit(V, np.ones((16, 3), np.float32), epochs=2, batch_size=4,
                      shuffle=False, verbose=0)
  flat('method/fit_loss', np.asarray(history.history['loss']), out)
  _weights('method/fit', model, out)


CASES = {'cnn': _cnn, 'method': _method}

PARTS = {
    'cnn': ['init', 'predict', 'training_call', 'after_training_call',
            'fit_loss', 'fit', 'predict_after_fit'],
    'method': ['variables', 'predict_encode', 'predict_function', 'fit_loss',
               'fit'],
}

if __name__ == '__main__':
  run_side(sys.argv[1:], CASES, before_import=_before_import)
