"""Studies and maintainer runs, run from a checkout (not installed).

``python -m benchmarks.<name>`` from the repository root:

* :mod:`benchmarks.convergence`: convergence against the papers' baselines
  (``docs/benchmarks.md``, section 5).
* :mod:`benchmarks.lioncub`: which Lion Cub options close the gap to global
  Lion, and what they cost (``docs/lioncub.md``).
* :mod:`benchmarks.network`: multi-process training steps over a
  bandwidth-capped loopback (``ip netns`` and ``tc``; shaping needs root)
  (``docs/benchmarks.md``, section 4).
* :mod:`benchmarks.soak`: many steps; replicas stay bit-identical and memory
  flat (``docs/reliability.md``).
* :mod:`benchmarks.study`: what the training studies share.

The benchmarks a user runs on their own hardware ship with the package as
:mod:`dlion_jax.bench`, whose helpers these modules share.
"""
