"""Fused vote kernels (Pallas): a leaf's encoding and its tally in one pass.

XLA compiles the vote's encoding, a loop over message words (``m`` codes to
a word), apart from the momentum's update, a loop over parameters: a step
reads a big leaf's gradient and momentum twice, and its tally unpacks every
worker's digits into arrays of their own. These kernels read each once:

* :func:`encode`: ``g`` and ``m`` in, the packed words of
  ``combine(g, m)`` and ``also(g, m)`` (Lion's new momentum, written over
  ``m``) out;
* :func:`tally`: ``K`` rows of words in (every worker's, ``allgather``; the
  summed counters, ``psum``), the vote's outcome out as ``int8``;
* :func:`vote_shard`: ``alltoall``'s vote on a worker's shard, every
  worker's words of it in, the packed results it gathers back out;
* :func:`decode`: the results ``alltoall`` gathers back in, the outcome of
  every digit of the message out, in rows of 128 lanes.

Layout: the planar order of :func:`dlion_jax.packing.leaf_planes`. A leaf
of ``R`` rows of ``C`` lanes (its leading axes merged) is ``m`` planes of
``H = R / m`` rows, and digit ``j`` of word ``(r, c)`` is the code of
element ``(j H + r, c)``. A kernel's block is ``[m, rows, lanes]`` values
and ``[rows, lanes]`` words: each word is packed or unpacked from ``m``
values in registers, and lanes never mix.

Invariant: the words are :func:`dlion_jax.packing.pack_planes` of
:func:`dlion_jax.quantize.encode`'s codes of ``combine``'s values, and the
outcomes :func:`dlion_jax.strategies.signed_sum`'s (its sign for a
majority vote), bit for bit. ``combine`` and ``also`` are the XLA path's
arithmetic; a compiler may contract their products and sums into fused
multiply-adds differently inside a kernel (see
:func:`dlion_jax.scale_by_distributed_lion`'s ``kernels``).

Where they run (:func:`platform`): on TPU through Mosaic, for leaves whose
planes fit its tiles (:func:`fits`); on GPU through Triton, with
``kernels='pallas'`` (not timed on a GPU yet: ``'auto'`` keeps XLA there).
Elsewhere, or with ``interpret=True``, Pallas' interpreter runs them as XLA
code: slow, for checking (``kernels='pallas'`` on CPU).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from dlion_jax import _blocks
from dlion_jax import _mesh
from dlion_jax import _packing
from dlion_jax import _quantize
from dlion_jax import _strategies

Kernels = Literal["auto", "pallas", "xla"]
KERNELS = get_args(Kernels)

# Rows of words a block: int8 and uint8 arrays are tiled by 32 rows.
BLOCK_ROWS = 32
# Lanes a block takes at most: ten planes of float32 g, m and m' double
# buffered are under 8 MiB of on-chip memory.
BLOCK_LANES = 512
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# On GPU (Triton) a block's lanes: a program's values stay in registers.
GPU_BLOCK_LANES = 128


def platform() -> str:
  """What the kernels are compiled for: ``'tpu'`` (Mosaic) where the step
  is traced for TPU chips (over their mesh, as ahead of time) or jax's
  default backend is a TPU; ``'gpu'`` (Triton) where it is a GPU; else
  ``'cpu'``, where they run in Pallas' interpreter."""
  if _mesh.on_tpu() or jax.default_backend() == "tpu":
    return "tpu"
  return "gpu" if jax.default_backend() == "gpu" else "cpu"


def interpreted() -> bool:
  """Whether the kernels run in Pallas' interpreter (:func:`platform`
  ``'cpu'``)."""
  return platform() == "cpu"


def _view(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(rows, lanes)`` the kernels see a leaf of ``shape`` as: its leading
  axes merged, or a flat leaf in rows of 128 lanes (on TPU either is the
  leaf's own layout)."""
  if len(shape) == 1:
    return shape[0] // _blocks.LANES, _blocks.LANES
  return math.prod(shape[:-1]), shape[-1]


def fits(shape: tuple[int, ...], dtypes, radix: int | None) -> bool:
  """Whether a leaf of ``shape`` (of ``dtypes``) is cut into blocks of the
  kernels: float32 or bfloat16, lanes a multiple of 128 (a flat leaf: in
  rows of 128), and its rows (leading axes merged) ``m`` planes (``m`` =
  :func:`dlion_jax.packing.digits_per_word`; 1 for ``radix=None``, a
  level a word) of whole blocks of rows: the planar order of
  :func:`dlion_jax.packing.leaf_planes`. The planes are cut along the
  leading axis, or the rows of a stack (three axes or more) are whole
  blocks (``shape[-2]`` a multiple of 32: on TPU, whose tiles are 32 rows
  or fewer, merging its axes moves nothing).

  Example:
    >>> from dlion_jax import _fused
    >>> import jax.numpy as jnp
    >>> _fused.fits((512, 256), [jnp.float32], 2)    # 8 planes of 64 rows
    True
    >>> _fused.fits((500, 256), [jnp.float32], 2)
    False
    >>> _fused.fits((18, 2048, 256), [jnp.float32], 2)   # 8 x 4608 rows
    True
  """
  m = 1 if radix is None else _packing.digits_per_word(radix)
  if not shape or shape[-1] % _blocks.LANES or (
      len(shape) > 2 and shape[0] % m and shape[-2] % BLOCK_ROWS):
    return False
  rows, _ = _view(shape)
  return rows % (m * BLOCK_ROWS) == 0 and all(
      jnp.dtype(d) in _FLOATS for d in dtypes)


def _grid(rows: int, lanes: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """The block ``(rows, lanes)`` of words, and the grid over ``[rows,
  lanes]`` words."""
  width = math.gcd(lanes, GPU_BLOCK_LANES if platform() == "gpu"
                   else BLOCK_LANES)
  return (BLOCK_ROWS, width), (rows // BLOCK_ROWS, lanes // width)


def _call(kernel, inputs, out_shape, in_specs, out_specs, grid, *,
          aliases, interpret, gpu_warps: int = 4, read: int | None = None,
          scratch: tuple = (), scalars: tuple = ()):
  """``pallas_call`` with the cost it declares: every operand (or ``read``
  bytes of them, where the grid reads a stretch) and output read or written
  once (XLA's cost analysis counts a kernel's bytes as it declares them).
  On TPU the inputs stay in HBM: XLA's memory-space
  assignment would otherwise stage a big leaf in on-chip memory and copy it
  back. On GPU Triton compiles them with ``gpu_warps`` warps a program
  (each kernel's the fewest whose registers hold a block without spilling,
  read off ptxas for sm_90: design notes, "Fused kernels"). ``scratch``:
  the kernel's on-chip buffers and DMA semaphores (TPU, interpreter).
  ``scalars``: traced scalars (whether this worker votes, the count of
  abstainers) whose refs the kernel gets first (:func:`_read_scalars`)."""
  if read is None:
    read = sum(x.size * x.dtype.itemsize for x in inputs)
  nbytes = read + sum(
      math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in out_shape)
  where = "cpu" if interpret else platform()
  if scalars:
    # In scalar memory on TPU: a kernel may not close over a traced value.
    space = {"memory_space": pltpu.SMEM} if where == "tpu" else {}
    in_specs = [pl.BlockSpec((1,), lambda *_: (0,), **space)
                for _ in scalars] + list(in_specs)
    aliases = {i + len(scalars): o for i, o in aliases.items()}
  inputs, out_shape = _typed_alike(
      [_scalar(x) for x in scalars] + list(inputs), out_shape)
  if where == "tpu":
    inputs[len(scalars):] = [_in_hbm(x) for x in inputs[len(scalars):]]
    params = pltpu.CompilerParams(
        dimension_semantics=("parallel",) * len(grid))
  elif where == "gpu":
    params = pltriton.CompilerParams(num_warps=gpu_warps, num_stages=1)
  else:
    params = None
  call = pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
      out_specs=out_specs, input_output_aliases=aliases,
      cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                    bytes_accessed=int(nbytes)),
      compiler_params=params, scratch_shapes=scratch,
      interpret=interpret)
  if interpret and out_shape[0].manual_axis_type.varying:
    raise ValueError(
        "kernels='pallas' runs the fused kernels in Pallas' interpreter off "
        "TPU, which cannot run inside jax.shard_map(..., check_vma=True) "
        "(it slices per-worker blocks at grid indices typed alike on every "
        "worker). Use kernels='auto' or 'xla' off TPU, or check_vma=False "
        "(dlion_jax.parallel.make_train_step's default).")
  return call(*inputs)


def _scalar(x) -> jax.Array:
  """A traced scalar as a kernel's input: one int32 (a bool as 0 or 1) or
  float32 element (scalar memory holds 32-bit words)."""
  x = jnp.asarray(x)
  wide = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32
  return x.astype(wide).reshape(1)


def _read_scalars(refs, scalars: tuple) -> list:
  """The values of ``scalars`` inside a kernel, from their refs: a bool
  read back as one."""
  return [ref[0] != 0 if jnp.asarray(x).dtype == jnp.bool_ else ref[0]
          for ref, x in zip(refs, scalars)]


def _in_hbm(x: jax.Array) -> jax.Array:
  """``x`` pinned to HBM; as it is under ``jax.vmap`` (a caller's vmapped
  kernels; the library's plain jitted step never takes them), which the
  constraint does not batch."""
  try:
    return pltpu.with_memory_space_constraint(x, pltpu.HBM)
  except NotImplementedError:
    return x


def _typed_alike(inputs, out_shape):
  """Inputs varying over the same manual axes (``shard_map(check_vma=True)``
  types each value by the axes it varies over), and outputs typed so."""
  varying = set()
  for x in inputs:
    varying |= jax.typeof(x).manual_axis_type.varying
  inputs = [lax.pcast(x, tuple(lost), to="varying") if (
      lost := varying - jax.typeof(x).manual_axis_type.varying) else x
            for x in inputs]
  mat = jax.typeof(inputs[0]).manual_axis_type
  return inputs, [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat)
                  for s in out_shape]


# In the kernels integers are 32-bit: Mosaic's integer vectors are 16 or 32
# bits (packing computes in the word's dtype by default, 8 bits for bytes,
# and sign_codes in int8).


def _codes(c: jax.Array, radix: int) -> jax.Array:
  """:func:`dlion_jax.quantize.sign_codes`, in 32 bits."""
  positive = (c > 0).astype(jnp.uint32)
  if radix == 2:
    return positive
  return jnp.uint32(1) + positive - (c < 0).astype(jnp.uint32)


def encode(combine: Callable[..., jax.Array], leaves: tuple[jax.Array, ...],
           *, spec: _quantize.VoteSpec, radix: int | None,
           also: Callable[..., jax.Array] | None = None,
           levels_dtype=None, scalars: tuple = (),
           flags: Callable[..., jax.Array] | None = None,
           interpret: bool = False):
  """One pass over a leaf: the packed words of ``combine(*leaves)``'s vote
  codes, and ``also(*leaves)`` (and ``flags(*leaves)``'s words).

  Args:
    combine: elementwise, of the leaves (Lion's ``(1 - b1) g + b1 m``).
    leaves: arrays of one shape that :func:`fits` (a gradient and a
      momentum).
    spec: the vote's codes (:func:`dlion_jax.quantize.encode`); a sign
      vote (L1-scaled votes need the whole leaf's scale first).
    radix: the radix the words pack the codes in (the vote's, or
      ``psum``'s counters'); None: no packing, each code's level (``-1``,
      ``0``, ``+1``) a word of ``levels_dtype`` (``psum_int8``'s message).
    also: elementwise, of the leaves: computed in the same pass and
      written over ``leaves[-1]`` (donated) where it has its dtype.
    levels_dtype: the words' dtype where ``radix`` is None.
    scalars: traced scalars ``combine``, ``also`` and ``flags`` take after
      the leaves (whether this worker votes, the count of abstainers).
    flags: elementwise, of the leaves, a bool: packed as digits 0 and 1
      in words of ``radix`` laid out as the codes' (where one worker alone
      votes, where its ``c`` is not 0: see ``dlion_jax._exchange``); needs
      a ``radix``.
    interpret: run Pallas' interpreter (any backend).

  Returns:
    ``(words, also_value)``: words ``[R / m, C]`` of
    :func:`dlion_jax.packing.word_dtype` ``(radix)`` (``R`` the leaf's
    rows), as :func:`dlion_jax.packing.pack_planes` packs the codes of
    :func:`dlion_jax.packing.leaf_planes`; ``also_value`` in the leaves'
    shape, or None. With ``flags``, ``flags``' words (as ``words``) third.
  """
  if spec.scaled:
    raise ValueError("_fused.encode takes sign votes; an L1-scaled vote "
                     "needs its leaf's scale before any code.")
  if flags is not None and radix is None:
    raise ValueError("_fused.encode packs flags in words of a radix; "
                     "radix=None writes levels.")
  shape = leaves[0].shape
  m = 1 if radix is None else _packing.digits_per_word(radix)
  rows, lanes = _view(shape)
  rows //= m
  planes = [x.reshape(m, rows, lanes) for x in leaves]
  block, grid = _grid(rows, lanes)
  plane_spec = pl.BlockSpec((m,) + block, lambda i, k: (0, i, k))
  word_spec = pl.BlockSpec(block, lambda i, k: (i, k))
  word_dtype = levels_dtype if radix is None else _packing.word_dtype(radix)
  out_shape = [jax.ShapeDtypeStruct((rows, lanes), word_dtype)]
  aliases = {}
  if also is not None:
    also_dtype = jax.eval_shape(also, *[jax.ShapeDtypeStruct(
        (), jnp.asarray(x).dtype) for x in tuple(leaves) + tuple(scalars)]
                                ).dtype
    out_shape.append(jax.ShapeDtypeStruct(planes[-1].shape, also_dtype))
    if also_dtype == leaves[-1].dtype:
      aliases = {len(leaves) - 1: 1}
  if flags is not None:
    out_shape.append(out_shape[0])

  def kernel(*refs):
    given = _read_scalars(refs, scalars)
    refs = refs[len(scalars):]
    ins, words_ref = refs[:len(leaves)], refs[len(leaves)]
    codes, flagged = [], []
    for j in range(m):
      values = [ref[j] for ref in ins] + given
      codes.append(_codes(combine(*values), spec.radix))
      if also is not None:
        refs[len(leaves) + 1][j] = also(*values)
      if flags is not None:
        flagged.append(flags(*values).astype(jnp.uint32))
    if radix is None:
      words_ref[...] = _strategies.signed_sum(codes[0], 1, spec).astype(
          word_dtype)
    else:
      words_ref[...] = _packing.pack_planes(
          codes, radix, dtype=jnp.uint32).astype(word_dtype)
    if flags is not None:
      refs[-1][...] = _packing.pack_planes(
          flagged, radix, dtype=jnp.uint32).astype(word_dtype)

  out = _call(kernel, planes, out_shape, [plane_spec] * len(leaves),
              [word_spec] + [plane_spec] * (also is not None)
              + [word_spec] * (flags is not None), grid,
              aliases=aliases, interpret=interpret, gpu_warps=8,
              scalars=scalars)
  also_value = out[1].reshape(shape) if also is not None else None
  if flags is not None:
    return out[0], also_value, out[-1]
  return out[0], also_value


def _digit_sum(rows: list[jax.Array], j: int, radix: int) -> jax.Array:
  """Digit ``j`` summed over ``rows`` of ``uint32`` words (every worker's):
  how many workers' codes, or their counters' sum, in 32 bits."""
  total = None
  for row in rows:
    digit = _packing.digit(row, j, radix)
    total = digit if total is None else total + digit
  return total


def tally(words: jax.Array, shape: tuple[int, ...], *, radix: int,
          num_workers: int, spec: _quantize.VoteSpec, aggregation: str,
          first_row: int = 0, abstained: jax.Array | None = None,
          interpret: bool = False) -> jax.Array:
  """The vote's outcome for one leaf, from ``K`` rows of its words.

  Args:
    words: ``[K, R C / m]`` (or ``[K, R / m, C]``) words of ``radix`` in
      the planar order (see the module docstring): every worker's own
      (``allgather``, ``K = N``) or the summed counters (``psum``,
      ``K = 1``).
    shape: the leaf's shape (``R`` rows of ``C``).
    radix: the words' radix.
    num_workers: N, whose codes the digits sum.
    spec: what each worker sent.
    aggregation: ``'mavo'`` (the outcome is ``sign(s)``) or ``'avg'``
      (``s`` itself), ``s`` the sum of the workers' levels.
    first_row: where the leaf's words start in ``words`` seen as ``[K,
      rows, C]``, a multiple of 32 (a block's rows): the leaf's stretch of
      a longer message, read where it lies (a slice would be a copy).
    abstained: the traced count of workers who sent ``c = 0`` (see
      :func:`dlion_jax.strategies.signed_sum`), or None.
    interpret: run Pallas' interpreter.

  Returns:
    The outcome in ``shape``, as ``int8`` (for ``'avg'`` the
    :func:`dlion_jax.strategies.int_container` of ``N`` workers' levels).
  """
  m = _packing.digits_per_word(radix)
  rows, lanes = _view(shape)
  rows //= m
  k = words.shape[0]
  words = words.reshape(k, -1, lanes)
  if first_row % BLOCK_ROWS or first_row + rows > words.shape[1]:
    raise ValueError(
        f"_fused.tally: first_row={first_row} must be a multiple of "
        f"{BLOCK_ROWS} with the leaf's {rows} rows of words within the "
        f"{words.shape[1]} given.")
  dtype = _strategies.int_container(
      num_workers if aggregation == "avg" else 1, spec)
  block, grid = _grid(rows, lanes)
  skip = first_row // BLOCK_ROWS
  word_spec = pl.BlockSpec((k,) + block, lambda i, j: (0, i + skip, j))
  out_spec = pl.BlockSpec((m,) + block, lambda i, j: (0, i, j))

  scalars = () if abstained is None else (abstained,)

  def kernel(*refs):
    count = (_read_scalars(refs, scalars) or [None])[0]
    words_ref, out_ref = refs[len(scalars):]
    rows = [words_ref[w].astype(jnp.uint32) for w in range(k)]
    for j in range(m):
      s = _strategies.signed_sum(_digit_sum(rows, j, radix), num_workers,
                                spec, count)
      if aggregation == "mavo":
        s = (s > 0).astype(jnp.int32) - (s < 0).astype(jnp.int32)
      out_ref[j] = s.astype(dtype)

  out, = _call(kernel, [words], [jax.ShapeDtypeStruct((m, rows, lanes),
                                                      dtype)],
               [word_spec], [out_spec], grid, aliases={},
               interpret=interpret, gpu_warps=16,
               read=k * rows * lanes * words.dtype.itemsize, scalars=scalars)
  return out.reshape(shape)


#: Results in a block of :func:`decode`'s output: 32 rows of 128 lanes. A
#: layout's ``result_blocks`` for it (:class:`dlion_jax.message.MessageLayout`).
DECODE_BLOCK = BLOCK_ROWS * _blocks.LANES


def planes_in_blocks(outcome_of, layout):
  """``planes(first, size)`` of a message whose outcome comes from one of
  the fused kernels block by block, ``outcome_of(first, count)`` giving
  ``[m, 32 count, 128]`` for blocks ``first`` to ``first + count`` of
  :data:`DECODE_BLOCK` words. A run of whole blocks before
  any other gets a call of its own: its outcome is an array the leaf's
  update reads where it lies, where a slice of the whole message's would
  be a copy (XLA:TPU made one). The rest of the message comes from one
  call."""
  block = DECODE_BLOCK
  rest = min((first for first, size in layout.run_words
              if first % block or size % block), default=layout.words)
  rest -= rest % block
  if rest < layout.words:
    tail = _strategies.planes_of_rows(
        outcome_of(rest // block, (layout.words - rest) // block))

  def planes(first, size):
    if first >= rest:
      return tail(first - rest, size)
    outcome = outcome_of(first // block, size // block)
    return outcome.reshape(outcome.shape[0], size)
  return planes


def decode(words: jax.Array, shard: int, *, radix: int, num_workers: int,
           spec: _quantize.VoteSpec, aggregation: str,
           blocks: tuple[int, int] | None = None,
           abstained: jax.Array | None = None,
           interpret: bool = False) -> jax.Array:
  """The vote's outcome for every digit of the message, from the results
  ``alltoall`` gathers back.

  On TPU (and in the interpreter) each block of results is read once: a
  grid step decodes every digit of it and copies each outcome block to its
  place (a block of the output a digit, ``Q / 4096`` blocks apart), where
  reading it once a digit read trits 5 times (the large tree's step on
  v5e: 25.6 -> 24.9 bytes a parameter a chip).
  On GPU a Triton program writes the one outcome block it is given.

  Args:
    words: ``[N, m, Q]`` words of ``radix`` (``Q`` the
      :attr:`~dlion_jax.message.MessageLayout.result_words` of a layout
      with ``result_blocks``, a multiple of :data:`DECODE_BLOCK`): worker
      ``k``'s results for digit place ``j``
      of its shard, packed planar (digit ``p`` of word ``q`` is the result
      for shard position ``p Q + q``).
    shard: words in a worker's shard of the message, a multiple of
      :data:`DECODE_BLOCK`.
    radix: the results' radix
      (:func:`dlion_jax.strategies.alltoall_down_radix`): a majority
      vote's sign (2 or 3 values) or the count of ``N`` workers' codes
      (``'avg'``).
    num_workers: N.
    spec: what each worker sent.
    aggregation: ``'mavo'`` or ``'avg'``.
    blocks: ``(first, count)``: only the message's words from ``first *
      DECODE_BLOCK`` to ``(first + count) * DECODE_BLOCK`` (a leaf's, its
      outcome an array of its own rather than a slice of the message's);
      None: every word.
    abstained: the traced count of workers who sent ``c = 0`` (Avg's
      counts take their binary ``-1`` back out), or None.
    interpret: run Pallas' interpreter.

  Returns:
    ``[m, N shard / 128, 128]`` (with ``blocks``, ``[m, 32 count, 128]``):
    row ``j`` read flat is the outcome (``sign(s)``, or ``s`` for
    ``'avg'``) of digit place ``j`` of every word of the message, as
    ``int8`` (``'avg'``: the :func:`dlion_jax.strategies.int_container` of
    ``N`` workers' levels).
  """
  n, m, q = words.shape
  first, count = blocks or (0, n * shard // DECODE_BLOCK)
  dtype = _strategies.int_container(
      num_workers if aggregation == "avg" else 1, spec)
  outcome = functools.partial(_decoded, radix=radix, num_workers=num_workers,
                              spec=spec, aggregation=aggregation, dtype=dtype)
  words = words.reshape(n, m, q // _blocks.LANES, _blocks.LANES)
  # Only Avg's counts need the count of abstainers (a sign is a sign).
  scalars = () if abstained is None or aggregation != "avg" else (
      abstained,)
  if platform() == "gpu" and not interpret:
    return _decode_by_block(words, shard, first, count, outcome, dtype,
                            radix=radix, interpret=False, scalars=scalars)
  return _decode_by_result(words, shard, first, count, outcome, dtype,
                           radix=radix, interpret=interpret, scalars=scalars)


def _decoded(digit, abstained=None, *, radix, num_workers, spec, aggregation,
             dtype):
  """The outcome a result digit stands for."""
  if aggregation == "avg":
    out = _strategies.signed_sum(digit, num_workers, spec, abstained)
  elif radix == 2:
    out = 2 * digit.astype(jnp.int32) - 1
  else:
    out = digit.astype(jnp.int32) - 1
  return out.astype(dtype)


def _result_groups(first: int, count: int, shard_blocks: int,
                   place_blocks: int) -> list[tuple[int, int, int, int]]:
  """The blocks of results that outcome blocks ``first`` to ``first +
  count`` are read from, as rectangles ``(worker, workers, block,
  blocks)``: block ``qb`` of a worker's results holds (digit ``p``) the
  outcome of its shard's block ``p place_blocks + qb``."""
  end, rects = first + count, []
  for k in range(first // shard_blocks, (end - 1) // shard_blocks + 1):
    a = max(first - k * shard_blocks, 0)
    e = min(end - k * shard_blocks, shard_blocks)
    lo = a % place_blocks
    if e - a >= place_blocks:
      spans = [(0, place_blocks)]
    elif lo + e - a <= place_blocks:
      spans = [(lo, e - a)]
    else:
      spans = [(0, lo + e - a - place_blocks), (lo, place_blocks - lo)]
    for qb, nqb in spans:
      last = rects[-1] if rects else None
      if last and last[2:] == (qb, nqb) and last[0] + last[1] == k:
        rects[-1] = (last[0], last[1] + 1, qb, nqb)
      else:
        rects.append((k, 1, qb, nqb))
  return rects


def _decode_by_result(words, shard, first, count, outcome, dtype, *,
                      radix, interpret, scalars=()):
  """:func:`decode` reading each block of results once (TPU, interpreter):
  a grid step decodes the ``per_word`` outcome blocks a result block holds
  and copies each that is in range to its place in the output."""
  m, per_word = words.shape[1], _packing.digits_per_word(radix)
  shard_blocks, place_blocks = shard // DECODE_BLOCK, words.shape[2] // (
      BLOCK_ROWS)
  rects = _result_groups(first, count, shard_blocks, place_blocks)
  offsets = [0]
  for _, nk, _, nqb in rects:
    offsets.append(offsets[-1] + nk * nqb)

  def group(s):            # the (worker, result block) grid step s reads
    k = qb = 0
    for (k0, nk, q0, nqb), off in zip(rects, offsets):
      local = s - off
      inside = (local >= 0) & (local < nk * nqb)
      k = jnp.where(inside, k0 + local // nqb, k)
      qb = jnp.where(inside, q0 + local % nqb, qb)
    return k, qb

  def kernel(*refs):
    given = _read_scalars(refs, scalars)
    words_ref, out_ref, decoded, sems = refs[len(scalars):]
    j = pl.program_id(0)
    k, qb = group(pl.program_id(1))
    row = words_ref[...].astype(jnp.uint32)

    def copy(p):     # digit p's outcome block: whether it is asked, its DMA
      b = k * shard_blocks + p * place_blocks + qb
      asked = ((p * place_blocks + qb < shard_blocks) & (b >= first)
               & (b < first + count))
      return asked, lambda: pltpu.make_async_copy(
          decoded.at[p], out_ref.at[j, pl.ds((b - first) * BLOCK_ROWS,
                                             BLOCK_ROWS)], sems.at[p])
    copies = []
    for p in range(per_word):
      decoded[p] = outcome(_packing.digit(row, p, radix), *given)
      asked, dma = copy(p)
      pl.when(asked)(lambda dma=dma: dma().start())
      copies.append((asked, dma))
    for asked, dma in copies:
      pl.when(asked)(lambda dma=dma: dma().wait())

  def word_block(j, s):
    k, qb = group(s)
    return k, j, qb, 0
  word_spec = pl.BlockSpec((None, None, BLOCK_ROWS, _blocks.LANES),
                           word_block)
  rows = count * BLOCK_ROWS
  out, = _call(kernel, [words],
               [jax.ShapeDtypeStruct((m, rows, _blocks.LANES), dtype)],
               [word_spec], [pl.BlockSpec(memory_space=pl.ANY)],
               (m, offsets[-1]), aliases={}, interpret=interpret,
               read=m * offsets[-1] * DECODE_BLOCK * words.dtype.itemsize,
               scratch=(pltpu.VMEM((per_word, BLOCK_ROWS, _blocks.LANES),
                                   dtype),
                        pltpu.SemaphoreType.DMA((per_word,))),
               scalars=scalars)
  return out


def _decode_by_block(words, shard, first, count, outcome, dtype, *, radix,
                     interpret, scalars=()):
  """:func:`decode` a grid step an outcome block (GPU: a Triton program
  writes its own block), reading the result block it is a digit of."""
  m, q = words.shape[1], words.shape[2] * _blocks.LANES
  rows = count * BLOCK_ROWS

  def segment(b):   # the shard and digit place a block of outcomes is in
    at = (first + b) * DECODE_BLOCK
    return at // shard, (at % shard) // q, (at % shard) % q // DECODE_BLOCK
  word_spec = pl.BlockSpec(
      (None, None, BLOCK_ROWS, _blocks.LANES),
      lambda j, b: (segment(b)[0], j, segment(b)[2], 0))
  out_spec = pl.BlockSpec((None, BLOCK_ROWS, _blocks.LANES),
                          lambda j, b: (j, b, 0))

  def kernel(*refs):
    given = _read_scalars(refs, scalars)
    words_ref, out_ref = refs[len(scalars):]
    place = segment(pl.program_id(1))[1]
    row = words_ref[...].astype(jnp.uint32)
    digit = _packing.digit(row, 0, radix)
    for p in range(1, _packing.digits_per_word(radix)):
      digit = jnp.where(place == p, _packing.digit(row, p, radix), digit)
    out_ref[...] = outcome(digit, *given)

  out, = _call(kernel, [words],
               [jax.ShapeDtypeStruct((m, rows, _blocks.LANES), dtype)],
               [word_spec], [out_spec], (m, count), aliases={},
               interpret=interpret, read=m * rows * _blocks.LANES
               * words.dtype.itemsize, scalars=scalars)
  return out


def vote_shard(mine: jax.Array, result_words: int, *, radix: int,
               down_radix: int, num_workers: int, spec: _quantize.VoteSpec,
               aggregation: str, abstained: jax.Array | None = None,
               interpret: bool = False) -> jax.Array:
  """``alltoall``'s vote on a worker's shard: every worker's words of it
  in, the packed results it gathers back out, in one pass.

  Args:
    mine: ``[N, S]`` words of ``radix`` (``S`` a multiple of
      :data:`DECODE_BLOCK`): every worker's words of this worker's shard,
      ``m`` digit places a word.
    result_words: ``Q``, words of results a place (a multiple of
      :data:`DECODE_BLOCK`, with ``S <= per_word Q``).
    radix: the words' radix (the vote's).
    down_radix: the results' (:func:`dlion_jax.strategies.alltoall_down_radix`).
    num_workers: N.
    spec: what each worker sent.
    aggregation: ``'mavo'`` (results: the vote's sign) or ``'avg'`` (the
      count of the workers' codes).
    abstained: the traced count of workers who sent ``c = 0`` (a
      majority's tally takes their binary ``-1`` back out), or None.
    interpret: run Pallas' interpreter.

  Returns:
    ``[m, Q]`` words of ``down_radix``: digit ``p`` of word ``(j, q)`` is
    the result for place ``j`` of shard word ``p Q + q`` (zero past
    ``S``), as :func:`dlion_jax.packing.pack_digits` packs them planar.
  """
  n, size = mine.shape
  m = _packing.digits_per_word(radix)
  per_word = _packing.digits_per_word(down_radix)
  q_blocks, last = result_words // DECODE_BLOCK, size // DECODE_BLOCK - 1
  block = (n, BLOCK_ROWS, _blocks.LANES)
  in_specs = [pl.BlockSpec(block, lambda b, p=p: (
      0, jnp.minimum(p * q_blocks + b, last), 0)) for p in range(per_word)]
  out_spec = pl.BlockSpec((m, BLOCK_ROWS, _blocks.LANES), lambda b: (0, b, 0))

  # Avg's results are counts, corrected where they are decoded.
  scalars = () if abstained is None or aggregation == "avg" else (
      abstained,)

  def kernel(*refs):
    count = (_read_scalars(refs, scalars) or [None])[0]
    refs = refs[len(scalars):]
    b = pl.program_id(0)
    words = [[ref[w].astype(jnp.uint32) for w in range(n)]
             for ref in refs[:per_word]]
    for j in range(m):
      packed = None
      for p in range(per_word):
        down = _strategies.alltoall_result(
            _digit_sum(words[p], j, radix), num_workers, spec, aggregation,
            down_radix, count).astype(jnp.int32)
        down = jnp.where(p * q_blocks + b <= last, down, 0) * down_radix ** p
        packed = down if packed is None else packed + down
      refs[-1][j] = packed.astype(refs[-1].dtype)

  word_dtype = _packing.word_dtype(down_radix)
  # The shard once an input, each read a block at its place value's rows.
  out, = _call(kernel, [mine.reshape(n, -1, _blocks.LANES)] * per_word,
               [jax.ShapeDtypeStruct(
                   (m, result_words // _blocks.LANES, _blocks.LANES),
                   word_dtype)],
               in_specs, [out_spec], (q_blocks,), aliases={},
               interpret=interpret,
               read=min(size, per_word * result_words) * n
               * mine.dtype.itemsize, scalars=scalars)
  return out.reshape(m, result_words)
