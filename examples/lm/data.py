"""Training text every Python installation has: the standard library's source.

The ``.py`` files at the top of the standard library directory (found with
``sysconfig``) are read as bytes, so tokens are byte values (vocabulary
256). Files are split into training and held-out sets by a hash of their
name, so the split does not depend on which other files exist.
"""
import pathlib
import sysconfig
import zlib

import numpy as np

SEPARATOR = b'\n\n'


def stdlib_files() -> list[pathlib.Path]:
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = sorted(root.glob('*.py'))
  if not files:
    raise FileNotFoundError(f'no .py files found in {root}')
  return files


def is_held_out(path: pathlib.Path, percent: int) -> bool:
  return zlib.crc32(path.name.encode()) % 100 < percent


def load(held_out_percent: int = 5, max_bytes: int | None = None):
  """``(train, held_out)``: uint8 arrays of concatenated file bytes.

  ``max_bytes`` caps each split (for quick runs and tests).
  """
  parts = {True: [], False: []}
  for path in stdlib_files():
    parts[is_held_out(path, held_out_percent)].append(path.read_bytes())
  train, held = (np.frombuffer(SEPARATOR.join(parts[k]), np.uint8)
                 for k in (False, True))
  if max_bytes is not None:
    train, held = train[:max_bytes], held[:max_bytes]
  return train, held


def batch(data: np.ndarray, rng: np.random.Generator, batch_size: int,
          length: int) -> np.ndarray:
  """``[batch_size, length + 1]`` int32 windows at random offsets: inputs
  are ``[:, :-1]``, targets ``[:, 1:]``."""
  return batch_rows(data, rng, batch_size, length, slice(None))


def batch_rows(data: np.ndarray, rng: np.random.Generator, batch_size: int,
               length: int, rows: slice) -> np.ndarray:
  """Rows ``rows`` of :func:`batch` (same ``rng`` state), reading only
  those rows' bytes: a process builds just its share of a global batch,
  and the shares of all processes make up the one-process batch."""
  starts = rng.integers(0, len(data) - length - 1, size=batch_size)[rows]
  idx = starts[:, None] + np.arange(length + 1)
  return data[idx].astype(np.int32)


def eval_batches(data: np.ndarray, num: int, batch_size: int, length: int):
  """A fixed list of held-out batches (the same every run)."""
  rng = np.random.default_rng(0)
  return [batch(data, rng, batch_size, length) for _ in range(num)]


def decode(tokens) -> str:
  return bytes(np.asarray(tokens, np.uint8).tolist()).decode(
      'utf-8', errors='replace')


def encode(text: str) -> np.ndarray:
  return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)
