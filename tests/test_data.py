"""Datasets, IDX parsing and the deterministic, resumable batcher."""

import doctest
import gzip
import itertools
import os

import numpy as np
import pytest

from dlion_jax.train import data

pytestmark = pytest.mark.integration

FASHION = data.FASHION_MNIST_PATH
HAVE_FASHION = all(
    os.path.exists(os.path.join(FASHION, f + ".gz"))
    or os.path.exists(os.path.join(FASHION, f))
    for f in data.FASHION_MNIST_FILES.values())
needs_fashion = pytest.mark.skipif(
    not HAVE_FASHION,
    reason=f"Fashion-MNIST not in {FASHION} (apt-get install "
    "dataset-fashion-mnist)")


def test_docstring_examples():
  result = doctest.testmod(data, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


# --- datasets ---------------------------------------------------------------

def test_digits_shapes_and_ranges():
  ds = data.load_digits()
  assert (ds.name, ds.kind, ds.num_classes, ds.input_shape) == (
      "digits", "classification", 10, (8, 8, 1))
  n_train, n_test = len(ds.train["y"]), len(ds.test["y"])
  assert n_train + n_test == 1797 and n_test == int(1797 * 0.2)
  for split in (ds.train, ds.test):
    assert split["x"].dtype == np.float32 and split["y"].dtype == np.int32
    assert split["x"].shape[1:] == (8, 8, 1)
    assert split["x"].min() == 0.0 and split["x"].max() == 1.0
    assert set(np.unique(split["y"])) == set(range(10))


def test_digits_split_is_deterministic_and_seeded():
  a, b, c = data.load_digits(), data.load_digits(), data.load_digits(seed=1)
  np.testing.assert_array_equal(a.train["x"], b.train["x"])
  assert not np.array_equal(a.train["y"], c.train["y"])


def test_dataset_is_frozen():
  ds = data.load_digits()
  with pytest.raises(AttributeError):
    ds.name = "other"


@needs_fashion
def test_fashion_mnist_with_limits():
  ds = data.load_fashion_mnist(limit_train=300, limit_test=100)
  assert (ds.name, ds.kind, ds.num_classes, ds.input_shape) == (
      "fashion_mnist", "classification", 10, (28, 28, 1))
  assert ds.train["x"].shape == (300, 28, 28, 1)
  assert ds.test["x"].shape == (100, 28, 28, 1)
  assert ds.train["x"].dtype == np.float32 and ds.train["y"].dtype == np.int32
  assert 0.0 <= ds.train["x"].min() and ds.train["x"].max() <= 1.0
  assert ds.train["x"].max() == 1.0
  assert ds.train["y"].min() >= 0 and ds.train["y"].max() <= 9
  assert len(np.unique(ds.train["y"])) == 10


def test_fashion_mnist_missing_path_names_the_package(tmp_path):
  with pytest.raises(FileNotFoundError) as info:
    data.load_fashion_mnist(str(tmp_path / "nowhere"))
  message = str(info.value)
  assert "train-images-idx3-ubyte" in message
  assert "dataset-fashion-mnist" in message and "apt-get install" in message
  assert "data.path" in message


def _write_idx(path, array, *, type_byte, compress):
  header = bytes([0, 0, type_byte, array.ndim])
  header += np.asarray(array.shape, ">u4").tobytes()
  payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
  opener = gzip.open if compress else open
  with opener(path, "wb") as f:
    f.write(payload)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_read_idx_handwritten(tmp_path, compress):
  images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  path = tmp_path / "images"
  _write_idx(path, images, type_byte=0x08, compress=compress)
  # By hand: magic 0x00000803, dims 2, 3, 4 big-endian.
  raw = (gzip.open if compress else open)(path, "rb").read()
  assert raw[:16] == bytes.fromhex("00000803" "00000002" "00000003"
                                   "00000004")
  np.testing.assert_array_equal(data.read_idx(str(path)), images)
  np.testing.assert_array_equal(data.read_idx(str(path), limit=1), images[:1])
  np.testing.assert_array_equal(data.read_idx(str(path), limit=9), images)


def test_read_idx_big_endian_int32(tmp_path):
  values = np.array([1, -2, 70000], np.int32)
  _write_idx(tmp_path / "v", values, type_byte=0x0C, compress=False)
  out = data.read_idx(str(tmp_path / "v"))
  np.testing.assert_array_equal(out, values)
  assert out.dtype == np.int32


def test_read_idx_errors(tmp_path):
  (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
  with pytest.raises(ValueError, match="not an IDX file"):
    data.read_idx(str(tmp_path / "bad"))
  (tmp_path / "short").write_bytes(bytes.fromhex("0000080100000005") + b"ab")
  with pytest.raises(ValueError, match="truncated"):
    data.read_idx(str(tmp_path / "short"))


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_fashion_mnist_from_handwritten_files(tmp_path, compress):
  rng = np.random.default_rng(0)
  for part, n in (("train", 6), ("t10k", 4)):
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    images[0, 0, 0] = 255
    labels = np.arange(n, dtype=np.uint8)
    suffix = ".gz" if compress else ""
    _write_idx(tmp_path / f"{part}-images-idx3-ubyte{suffix}", images,
               type_byte=0x08, compress=compress)
    _write_idx(tmp_path / f"{part}-labels-idx1-ubyte{suffix}", labels,
               type_byte=0x08, compress=compress)
  ds = data.load_fashion_mnist(str(tmp_path), limit_test=3)
  assert ds.train["x"].shape == (6, 28, 28, 1)
  assert ds.test["y"].tolist() == [0, 1, 2]
  assert ds.train["x"][0, 0, 0, 0] == 1.0


def test_text(tmp_path):
  path = tmp_path / "book.txt"
  content = bytes(range(256)) * 4
  path.write_bytes(content)
  ds = data.load_text(str(path), test_fraction=0.25)
  assert (ds.kind, ds.vocab_size, ds.name) == ("lm", 256, "text")
  assert ds.train["tokens"].dtype == np.uint8
  assert len(ds.train["tokens"]) == 768 and len(ds.test["tokens"]) == 256
  assert bytes(np.concatenate([ds.train["tokens"], ds.test["tokens"]])) == (
      content)


def test_text_limit_test_keeps_the_first_evaluation_windows(tmp_path):
  path = tmp_path / "book.txt"
  path.write_bytes(bytes(range(256)) * 4)
  full = data.load_text(str(path), test_fraction=0.25, seq_len=10)
  cut = data.load_text(str(path), test_fraction=0.25, seq_len=10,
                       limit_test=3)
  np.testing.assert_array_equal(cut.train["tokens"], full.train["tokens"])
  np.testing.assert_array_equal(cut.test["tokens"],
                                full.test["tokens"][:31])
  assert len(list(data.eval_batches(cut.test, 100, seq_len=10))[0]["x"]) == 3
  with pytest.raises(ValueError, match="pass seq_len"):
    data.load_text(str(path), limit_test=3)


def test_text_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.path"):
    data.load_text(str(tmp_path / "missing.txt"))
  (tmp_path / "tiny.txt").write_bytes(b"hello world")
  with pytest.raises(ValueError, match="at least 65"):
    data.load_text(str(tmp_path / "tiny.txt"), seq_len=64)
  with pytest.raises(ValueError, match="test_fraction"):
    data.load_text(str(tmp_path / "tiny.txt"), test_fraction=1.5)


def test_load_dataset_dispatch(tmp_path):
  assert data.load_dataset("digits").name == "digits"
  (tmp_path / "t.txt").write_bytes(b"abc" * 100)
  assert data.load_dataset("text", path=str(tmp_path / "t.txt")).kind == "lm"
  with pytest.raises(ValueError, match="'digits', 'fashion_mnist', 'text'"):
    data.load_dataset("cifar10")
  with pytest.raises(TypeError, match="'limit_train'"):
    data.load_dataset("digits", limit_train=10)


# --- Batches ----------------------------------------------------------------

def _classification_split(n=50):
  return {"x": np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1),
          "y": np.arange(n, dtype=np.int32)}


def _lm_split(n=500):
  return {"tokens": (np.arange(n) % 251).astype(np.uint8)}


def _make(kind, **kwargs):
  if kind == "lm":
    return data.Batches(_lm_split(), kind="lm", seq_len=8, **kwargs)
  return data.Batches(_classification_split(), kind="classification",
                      **kwargs)


def _take(batches, k):
  return list(itertools.islice(batches, k))


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


@pytest.mark.parametrize("kind", ["classification", "lm"])
def test_batches_deterministic(kind):
  _assert_same(_take(_make(kind, global_batch=8, seed=3), 10),
               _take(_make(kind, global_batch=8, seed=3), 10))
  a = _take(_make(kind, global_batch=8, seed=3), 3)
  b = _take(_make(kind, global_batch=8, seed=4), 3)
  assert not np.array_equal(a[0]["y"], b[0]["y"])


@pytest.mark.parametrize("kind", ["classification", "lm"])
@pytest.mark.parametrize("k", [0, 4, 6, 7])  # 50 // 8 = 6 batches per epoch
def test_batches_resume(kind, k):
  batches = _make(kind, global_batch=8, seed=1)
  _take(batches, k)
  state = batches.state()
  assert all(isinstance(v, int) and not isinstance(v, bool)
             for v in state.values())
  expected = _take(batches, 9)
  fresh = _make(kind, global_batch=8, seed=1)
  fresh.restore({key: np.asarray(v) for key, v in state.items()})
  _assert_same(_take(fresh, 9), expected)


def test_classification_epochs():
  batches = _make("classification", global_batch=8, seed=0)
  assert batches.steps_per_epoch == 6
  epoch0 = np.concatenate([b["y"] for b in _take(batches, 6)])
  epoch1 = np.concatenate([b["y"] for b in _take(batches, 6)])
  # Each epoch: 48 distinct examples (the 2 left over are dropped), new order.
  assert len(set(epoch0.tolist())) == 48 and len(set(epoch1.tolist())) == 48
  assert not np.array_equal(epoch0, epoch1)
  perm = np.random.default_rng([0, 1]).permutation(50)[:48]
  np.testing.assert_array_equal(epoch1, perm)
  assert batches.state()["epoch"] == 1
  batch = next(batches)
  assert batch["x"].shape == (8, 1, 1, 1) and batch["y"].dtype == np.int32
  np.testing.assert_array_equal(batch["x"][:, 0, 0, 0], batch["y"])


def test_lm_batches_are_next_byte_windows():
  split = _lm_split()
  batch = data.Batches(split, global_batch=4, seed=0, kind="lm",
                       seq_len=8).next()
  assert batch["x"].shape == batch["y"].shape == (4, 8)
  assert batch["x"].dtype == batch["y"].dtype == np.int32
  for x, y in zip(batch["x"], batch["y"]):
    start = int(np.flatnonzero(
        np.all(np.lib.stride_tricks.sliding_window_view(
            split["tokens"], 8) == x, axis=1))[0])
    np.testing.assert_array_equal(y, split["tokens"][start + 1:start + 9])


def test_batches_errors():
  split = _classification_split(10)
  with pytest.raises(ValueError, match="global_batch=11 is larger"):
    data.Batches(split, global_batch=11, seed=0, kind="classification")
  with pytest.raises(ValueError, match="global_batch must be a positive int"):
    data.Batches(split, global_batch=0, seed=0, kind="classification")
  with pytest.raises(ValueError, match="seed must be a non-negative"):
    data.Batches(split, global_batch=2, seed=-1, kind="classification")
  with pytest.raises(ValueError, match="Unknown kind='images'"):
    data.Batches(split, global_batch=2, seed=0, kind="images")
  with pytest.raises(ValueError, match="missing"):
    data.Batches(split, global_batch=2, seed=0, kind="lm", seq_len=4)
  with pytest.raises(ValueError, match="only for kind='lm'"):
    data.Batches(split, global_batch=2, seed=0, kind="classification",
                 seq_len=4)
  with pytest.raises(ValueError, match="needs seq_len"):
    data.Batches(_lm_split(), global_batch=2, seed=0, kind="lm")
  with pytest.raises(ValueError, match="fewer than seq_len"):
    data.Batches(_lm_split(10), global_batch=2, seed=0, kind="lm", seq_len=10)
  batches = data.Batches(split, global_batch=2, seed=0, kind="classification")
  with pytest.raises(ValueError, match="seed=5"):
    batches.restore({"epoch": 0, "position": 0, "step": 0, "seed": 5})
  with pytest.raises(ValueError, match="missing"):
    batches.restore({"epoch": 0})


# --- eval_batches -----------------------------------------------------------

def test_eval_batches_classification():
  split = _classification_split(10)
  batches = list(data.eval_batches(split, 4))
  assert [len(b["y"]) for b in batches] == [4, 4, 2]
  np.testing.assert_array_equal(
      np.concatenate([b["y"] for b in batches]), split["y"])
  padded = list(data.eval_batches(split, 4, pad=True))
  assert all(len(b["y"]) == 4 for b in padded)
  assert padded[-1]["mask"].tolist() == [True, True, False, False]
  assert sum(int(b["mask"].sum()) for b in padded) == 10


def test_eval_batches_lm():
  split = _lm_split(30)
  batches = list(data.eval_batches(split, 2, seq_len=4))
  x = np.concatenate([b["x"] for b in batches])
  y = np.concatenate([b["y"] for b in batches])
  assert x.shape == (7, 4) and x.dtype == np.int32  # (30 - 1) // 4 windows
  np.testing.assert_array_equal(x.ravel(), split["tokens"][:28])
  np.testing.assert_array_equal(y.ravel(), split["tokens"][1:29])
  with pytest.raises(ValueError, match="needs seq_len"):
    list(data.eval_batches(split, 2))
