"""Datasets for the training examples and a deterministic, resumable batcher.

Datasets are small numpy arrays held in memory:

* ``'digits'``: scikit-learn's 8x8 handwritten digits (ships inside the
  scikit-learn wheel, no download), :func:`load_digits`.
* ``'fashion_mnist'``: 28x28 Fashion-MNIST from IDX files, e.g. Debian's
  ``dataset-fashion-mnist`` package, :func:`load_fashion_mnist`.
* ``'text'``: the bytes of any file as a byte-level language-modelling
  corpus, :func:`load_text`.

:class:`Batches` draws global batches as a pure function of ``(seed,
position)``; its :meth:`Batches.state` is a dict of plain ints, so a resumed
run sees exactly the batches an uninterrupted one would. :func:`eval_batches`
walks a split in a fixed order.

Example:

>>> ds = load_digits()
>>> ds.train["x"].shape, ds.train["y"].dtype, ds.num_classes
((1438, 8, 8, 1), dtype('int32'), 10)
>>> batches = Batches(ds.train, global_batch=32, seed=0, kind=ds.kind)
>>> batch = next(batches)
>>> batch["x"].shape, batch["y"].shape
((32, 8, 8, 1), (32,))
>>> batches.state()
{'epoch': 0, 'position': 1, 'step': 1, 'seed': 0, 'global_batch': 32}
"""

from __future__ import annotations

import dataclasses
import gzip
import inspect
import os
from typing import Any, Iterator, Mapping

import numpy as np

Split = dict[str, np.ndarray]

KINDS = ("classification", "lm")
FASHION_MNIST_PATH = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

# IDX type byte -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


@dataclasses.dataclass(frozen=True)
class Dataset:
  """An in-memory dataset with a train and a test split.

  Attributes:
    name: the dataset's name (``'digits'``, ``'fashion_mnist'``, ``'text'``).
    kind: ``'classification'`` or ``'lm'``.
    train: the training split. Classification: ``{'x': float32 [n, H, W, C]
      in [0, 1], 'y': int32 [n]}``. LM: ``{'tokens': uint8 [n_bytes]}``.
    test: the test split, same layout as ``train``.
    num_classes: number of labels (classification), else ``None``.
    vocab_size: number of tokens (256 for ``'lm'``), else ``None``.
    input_shape: shape of one example, ``(H, W, C)`` for images; ``()`` for
      LM, whose examples are windows cut by :class:`Batches`.
  """
  name: str
  kind: str
  train: Split
  test: Split
  num_classes: int | None = None
  vocab_size: int | None = None
  input_shape: tuple[int, ...] = ()


def _check_fraction(name: str, value: Any) -> None:
  if not isinstance(value, (int, float)) or not 0 < value < 1:
    raise ValueError(f"{name} must be a number in (0, 1), got {value!r}.")


def _check_count(name: str, value: Any, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < 1):
    raise ValueError(f"{name} must be a positive int, got {value!r}.")


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """scikit-learn's 8x8 digits (1797 images), split by a fixed permutation.

  Args:
    test_fraction: fraction of the images held out for the test split.
    seed: seed of the permutation that assigns images to the splits.

  Returns:
    A classification :class:`Dataset` of 8x8x1 float32 images in [0, 1].
  """
  _check_fraction("test_fraction", test_fraction)
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_test = max(1, int(len(y) * test_fraction))
  test, train = order[:n_test], order[n_test:]
  return Dataset(
      name="digits", kind="classification",
      train={"x": x[train], "y": y[train]}, test={"x": x[test], "y": y[test]},
      num_classes=10, input_shape=(8, 8, 1))


def _open(path: str):
  """Opens ``path`` for reading bytes, decompressing gzip (by magic bytes)."""
  with open(path, "rb") as f:
    magic = f.read(2)
  return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_idx(path: str, *, limit: int | None = None) -> np.ndarray:
  """Reads an IDX file (the MNIST format), plain or gzipped.

  The header is two zero bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B
  int16, 0x0C int32, 0x0D float32, 0x0E float64), the number of dimensions,
  and one big-endian uint32 per dimension; the big-endian data follows.

  Args:
    path: the file; gzip is detected from its first bytes, not its name.
    limit: read only the first ``limit`` items along the first dimension.

  Returns:
    The array, in native byte order, of shape ``dims`` (first dim cut to
    ``limit``).

  Raises:
    ValueError: if the header is malformed or the file is too short.
  """
  _check_count("limit", limit, allow_none=True)
  with _open(path) as f:
    header = f.read(4)
    if len(header) < 4 or header[:2] != b"\0\0" or header[2] not in _IDX_DTYPES:
      raise ValueError(
          f"{path} is not an IDX file: its header {header!r} should be two "
          "zero bytes, a type byte in "
          f"{[hex(t) for t in _IDX_DTYPES]} and the number of dimensions.")
    dtype, ndim = _IDX_DTYPES[header[2]], header[3]
    dims = list(np.frombuffer(f.read(4 * ndim), ">u4").astype(int))
    if len(dims) != ndim:
      raise ValueError(f"{path}: truncated IDX header ({ndim} dims expected).")
    if limit is not None and dims:
      dims[0] = min(dims[0], limit)
    size = int(np.prod(dims)) * dtype.itemsize
    data = f.read(size)
  if len(data) != size:
    raise ValueError(
        f"{path}: IDX header says shape {tuple(dims)} ({size} bytes of data) "
        f"but the file holds only {len(data)}; is it truncated?")
  array = np.frombuffer(data, dtype).reshape(dims)
  return array.astype(dtype.newbyteorder("="))


def _find_idx(directory: str, name: str) -> str:
  """Returns ``directory/name`` or ``directory/name.gz``, whichever exists."""
  candidates = [os.path.join(directory, name + ext) for ext in (".gz", "")]
  for candidate in candidates:
    if os.path.isfile(candidate):
      return candidate
  raise FileNotFoundError(
      f"Fashion-MNIST file {name}(.gz) not found: looked for "
      f"{' and '.join(candidates)}. Debian's package dataset-fashion-mnist "
      f"provides them in {FASHION_MNIST_PATH} (apt-get install "
      "dataset-fashion-mnist); or set data.path in the config to a directory "
      f"holding {', '.join(FASHION_MNIST_FILES.values())} (gzipped or not).")


def load_fashion_mnist(path: str = FASHION_MNIST_PATH, *,
                       limit_train: int | None = None,
                       limit_test: int | None = None) -> Dataset:
  """Fashion-MNIST (Xiao et al. 2017) from its four IDX files.

  Args:
    path: directory holding ``train-images-idx3-ubyte``,
      ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
      ``t10k-labels-idx1-ubyte``, each optionally ``.gz``.
    limit_train: keep only the first ``limit_train`` training examples.
    limit_test: keep only the first ``limit_test`` test examples.

  Returns:
    A classification :class:`Dataset` of 28x28x1 float32 images in [0, 1]
    (60000 train, 10000 test without limits) and int32 labels in [0, 10).

  Raises:
    FileNotFoundError: naming the missing file and where to get it.
  """
  _check_count("limit_train", limit_train, allow_none=True)
  _check_count("limit_test", limit_test, allow_none=True)
  split = {}
  for part, limit in (("train", limit_train), ("test", limit_test)):
    images = read_idx(_find_idx(path, FASHION_MNIST_FILES[part + "_x"]),
                      limit=limit)
    labels = read_idx(_find_idx(path, FASHION_MNIST_FILES[part + "_y"]),
                      limit=limit)
    if images.ndim != 3 or len(images) != len(labels):
      raise ValueError(
          f"{path}: {part} images have shape {images.shape} and labels "
          f"{labels.shape}; expected [n, 28, 28] and [n].")
    x = (images[..., None] / np.float32(255)).astype(np.float32)
    split[part] = {"x": x, "y": labels.astype(np.int32)}
  return Dataset(
      name="fashion_mnist", kind="classification", train=split["train"],
      test=split["test"], num_classes=10,
      input_shape=tuple(split["train"]["x"].shape[1:]))


def load_text(path: str, *, test_fraction: float = 0.1,
              seq_len: int | None = None,
              limit_test: int | None = None) -> Dataset:
  """The bytes of a file as byte-level LM tokens; the last bytes are the test.

  Args:
    path: any file (text or not); every byte is a token in [0, 256).
    test_fraction: fraction of the bytes, taken from the end, held out.
    seq_len: if given, check that each split holds at least one window of
      ``seq_len + 1`` bytes (inputs plus the shifted targets).
    limit_test: keep only the first ``limit_test`` evaluation windows of the
      test split (needs ``seq_len``): a cheaper evaluation of a large file.

  Returns:
    An ``'lm'`` :class:`Dataset` with ``{'tokens': uint8 [n]}`` splits.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: if a split would be shorter than needed.
  """
  _check_fraction("test_fraction", test_fraction)
  _check_count("seq_len", seq_len, allow_none=True)
  _check_count("limit_test", limit_test, allow_none=True)
  if limit_test is not None and seq_len is None:
    raise ValueError(f"limit_test={limit_test} counts windows of seq_len "
                     "bytes: pass seq_len too.")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"Text file {path!r} not found; set data.path in the config to a "
        "file whose bytes to train on (any text file, e.g. a book or "
        "source code).")
  with open(path, "rb") as f:
    tokens = np.frombuffer(f.read(), np.uint8).copy()
  n_test = int(len(tokens) * test_fraction)
  train, test = tokens[:len(tokens) - n_test], tokens[len(tokens) - n_test:]
  if limit_test is not None:
    test = test[:limit_test * seq_len + 1]
  need = 2 if seq_len is None else seq_len + 1
  if min(len(train), len(test)) < need:
    raise ValueError(
        f"{path} has {len(tokens)} bytes: with test_fraction={test_fraction} "
        f"the train/test splits get {len(train)}/{len(test)} bytes, but each "
        f"needs at least {need} (seq_len + 1). Use a larger file, a smaller "
        "seq_len or another test_fraction.")
  return Dataset(name="text", kind="lm", train={"tokens": train},
                 test={"tokens": test}, vocab_size=256)


LOADERS = {
    "digits": load_digits,
    "fashion_mnist": load_fashion_mnist,
    "text": load_text,
}


def load_dataset(name: str, **kwargs: Any) -> Dataset:
  """Loads ``LOADERS[name](**kwargs)``, checking the name and keywords.

  Args:
    name: ``'digits'``, ``'fashion_mnist'`` or ``'text'``.
    **kwargs: the loader's arguments (e.g. ``path``, ``limit_train``).

  Returns:
    The :class:`Dataset`.

  Raises:
    ValueError: for an unknown ``name``.
    TypeError: for a keyword the loader does not take.

  Example:

  >>> load_dataset("digits", test_fraction=0.5).test["y"].shape
  (898,)
  """
  if name not in LOADERS:
    raise ValueError(
        f"Unknown dataset name={name!r}. Valid names are: "
        f"{', '.join(repr(n) for n in LOADERS)}.")
  valid = list(inspect.signature(LOADERS[name]).parameters)
  for key in kwargs:
    if key not in valid:
      raise TypeError(
          f"Dataset {name!r} got an unexpected keyword argument {key!r}. "
          f"Valid keywords are: {', '.join(valid)}.")
  return LOADERS[name](**kwargs)


def _check_split(split: Mapping[str, np.ndarray], kind: str) -> int:
  """Validates a split's keys for ``kind``; returns its length."""
  if kind not in KINDS:
    raise ValueError(f"Unknown kind={kind!r}. Valid values are: "
                     f"{', '.join(repr(k) for k in KINDS)}.")
  keys = ("x", "y") if kind == "classification" else ("tokens",)
  missing = [k for k in keys if k not in split]
  if missing:
    raise ValueError(
        f"A {kind!r} split needs the keys {keys}; got {tuple(split)} "
        f"(missing {missing}).")
  if kind == "classification" and len(split["x"]) != len(split["y"]):
    raise ValueError(f"split['x'] has {len(split['x'])} rows but split['y'] "
                     f"has {len(split['y'])}.")
  return len(split[keys[0]])


class Batches:
  """Deterministic, resumable iterator over global batches of a split.

  * ``kind='classification'``: epoch ``e`` visits the examples in the order
    ``np.random.default_rng([seed, e]).permutation(n)``, ``global_batch``
    consecutive indices per batch; the incomplete last batch of an epoch is
    dropped. Batches are ``{'x': ..., 'y': ...}`` rows of the split.
  * ``kind='lm'``: step ``s`` takes ``global_batch`` windows of ``seq_len + 1``
    bytes at offsets drawn from ``np.random.default_rng([seed, s])`` (with
    replacement) and returns ``{'x': int32 [B, seq_len], 'y': int32 [B,
    seq_len]}``, ``y`` being ``x`` shifted by one byte (next-byte targets).

  The iterator is infinite. :meth:`state` returns plain ints;
  :meth:`restore` on a fresh iterator of the same split, batch and seed
  continues exactly where the saved one was.

  Args:
    split: a dataset split (``Dataset.train``).
    global_batch: examples per batch, over all workers.
    seed: the data-order seed (a non-negative int).
    kind: ``'classification'`` or ``'lm'``.
    seq_len: tokens per LM example (required for, and only for, ``'lm'``).

  Example:

  >>> split = {"tokens": np.arange(100, dtype=np.uint8)}
  >>> batches = Batches(split, global_batch=2, seed=0, kind="lm", seq_len=4)
  >>> b = next(batches)
  >>> b["x"].shape, bool((b["y"][:, :-1] == b["x"][:, 1:]).all())
  ((2, 4), True)
  >>> again = Batches(split, global_batch=2, seed=0, kind="lm", seq_len=4)
  >>> again.restore(batches.state())
  >>> bool((next(again)["x"] == next(batches)["x"]).all())
  True
  """

  def __init__(self, split: Mapping[str, np.ndarray], *, global_batch: int,
               seed: int, kind: str, seq_len: int | None = None):
    n = _check_split(split, kind)
    _check_count("global_batch", global_batch)
    if (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
        or seed < 0):
      raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    if kind == "lm":
      if seq_len is None:
        raise ValueError("kind='lm' needs seq_len (tokens per example).")
      _check_count("seq_len", seq_len)
      if n < seq_len + 1:
        raise ValueError(
            f"The split has {n} tokens, fewer than seq_len + 1 = "
            f"{seq_len + 1}; use a smaller seq_len or a longer text.")
    else:
      if seq_len is not None:
        raise ValueError(
            f"seq_len={seq_len!r} is only for kind='lm'; pass seq_len=None "
            "for classification.")
      if global_batch > n:
        raise ValueError(
            f"global_batch={global_batch} is larger than the split "
            f"({n} examples); use global_batch <= {n}.")
    self._split = split
    self._n = n
    self.global_batch = int(global_batch)
    self.seed = int(seed)
    self.kind = kind
    self.seq_len = seq_len
    self._epoch = self._position = self._step = 0
    self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation)

  @property
  def steps_per_epoch(self) -> int | None:
    """Batches per epoch (classification), ``None`` for LM."""
    if self.kind == "lm":
      return None
    return self._n // self.global_batch

  def _permutation(self, epoch: int) -> np.ndarray:
    if self._order is None or self._order[0] != epoch:
      self._order = (epoch,
                     np.random.default_rng([self.seed, epoch]).permutation(
                         self._n))
    return self._order[1]

  def _classification_batch(self) -> Split:
    if self._position >= self.steps_per_epoch:
      self._epoch, self._position = self._epoch + 1, 0
    start = self._position * self.global_batch
    index = self._permutation(self._epoch)[start:start + self.global_batch]
    self._position += 1
    return {"x": self._split["x"][index], "y": self._split["y"][index]}

  def _lm_batch(self) -> Split:
    tokens = self._split["tokens"]
    rng = np.random.default_rng([self.seed, self._step])
    offsets = rng.integers(0, self._n - self.seq_len, size=self.global_batch)
    windows = tokens[offsets[:, None] + np.arange(self.seq_len + 1)]
    windows = windows.astype(np.int32)
    return {"x": windows[:, :-1], "y": windows[:, 1:]}

  def next(self) -> Split:
    """Returns the next global batch (a dict of numpy arrays)."""
    if self.kind == "lm":
      batch = self._lm_batch()
    else:
      batch = self._classification_batch()
    self._step += 1
    return batch

  def __next__(self) -> Split:
    return self.next()

  def __iter__(self) -> Iterator[Split]:
    return self

  def state(self) -> dict[str, int]:
    """Where the iterator stands, as plain ints (JSON/checkpoint friendly).

    ``epoch`` and ``position`` (batches taken in that epoch) place a
    classification iterator, ``step`` (batches taken in all) an LM one;
    ``seed`` and ``global_batch`` are checked by :meth:`restore`.
    """
    return {"epoch": self._epoch, "position": self._position,
            "step": self._step, "seed": self.seed,
            "global_batch": self.global_batch}

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues from a :meth:`state`; values may be numpy/0-d arrays.

    Raises:
      ValueError: if keys are missing, or the state was saved with another
        ``seed``/``global_batch`` (it would not resume the same sequence).
    """
    missing = [k for k in ("epoch", "position", "step") if k not in state]
    if missing:
      raise ValueError(f"Batches state {dict(state)} is missing {missing}.")
    for key in ("seed", "global_batch"):
      if key in state and int(state[key]) != getattr(self, key):
        raise ValueError(
            f"Batches state was saved with {key}={int(state[key])} but this "
            f"iterator has {key}={getattr(self, key)}; resume with the same "
            "data settings.")
    self._epoch = int(state["epoch"])
    self._position = int(state["position"])
    self._step = int(state["step"])


def eval_batches(split: Mapping[str, np.ndarray], batch_size: int, *,
                 seq_len: int | None = None,
                 pad: bool = False) -> Iterator[Split]:
  """Fixed-order batches that cover a split once (for evaluation).

  Classification splits (keys ``'x'``, ``'y'``) yield consecutive rows.
  LM splits (key ``'tokens'``) are cut into consecutive non-overlapping
  windows ``x = tokens[i*L:(i+1)*L]``, ``y = tokens[i*L+1:(i+1)*L+1]``
  (``L = seq_len``); the final partial window is dropped.

  With ``pad=False`` every batch has ``batch_size`` examples except possibly
  the last, which is smaller. With ``pad=True`` every batch has exactly
  ``batch_size`` examples (handy when a batch must divide over workers) and
  a ``'mask'`` entry, bool ``[batch_size]``: the last batch is padded with
  zero examples whose mask is ``False``; weight metrics by it.

  Args:
    split: a dataset split (``Dataset.test``).
    batch_size: examples per batch.
    seq_len: window length, required for LM splits.
    pad: pad the last batch and add ``'mask'`` (see above).

  Yields:
    Dicts of numpy arrays.

  Example:

  >>> split = {"x": np.zeros((5, 2, 2, 1), np.float32), "y": np.arange(5)}
  >>> [len(b["y"]) for b in eval_batches(split, 2)]
  [2, 2, 1]
  >>> [b["mask"].tolist() for b in eval_batches(split, 3, pad=True)]
  [[True, True, True], [True, True, False]]
  """
  _check_count("batch_size", batch_size)
  if "tokens" in split:
    _check_split(split, "lm")
    if seq_len is None:
      raise ValueError("An LM split ('tokens') needs seq_len.")
    _check_count("seq_len", seq_len)
    tokens = np.asarray(split["tokens"])
    count = (len(tokens) - 1) // seq_len
    if count < 1:
      raise ValueError(f"The split has {len(tokens)} tokens, fewer than "
                       f"seq_len + 1 = {seq_len + 1}.")
    rows = {"x": tokens[:count * seq_len].reshape(count, seq_len),
            "y": tokens[1:count * seq_len + 1].reshape(count, seq_len)}
    rows = {k: v.astype(np.int32) for k, v in rows.items()}
  else:
    count = _check_split(split, "classification")
    rows = {"x": split["x"], "y": split["y"]}
  for start in range(0, count, batch_size):
    batch = {k: v[start:start + batch_size] for k, v in rows.items()}
    if pad:
      size = len(batch["y"])
      batch = {k: np.concatenate(
          [v, np.zeros((batch_size - size, *v.shape[1:]), v.dtype)])
               for k, v in batch.items()}
      batch["mask"] = np.arange(batch_size) < size
    yield batch
