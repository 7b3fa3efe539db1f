"""Training examples: Flax models, data, the train CLI (extra: [examples])."""

# The [examples] extra: import name -> package name.
EXTRA_PACKAGES = {"flax": "flax", "orbax": "orbax-checkpoint",
                  "yaml": "pyyaml", "tqdm": "tqdm",
                  "matplotlib": "matplotlib", "sklearn": "scikit-learn"}


def missing_extra(error: BaseException, program: str) -> str | None:
  """The line to print when ``error`` is a package of the [examples] extra
  that is not installed, else None."""
  name = getattr(error, "name", None) or ""
  if (not isinstance(error, ModuleNotFoundError)
      or name.split(".")[0] not in EXTRA_PACKAGES):
    return None
  return (f"error: {program} needs the [examples] extra "
          f"({', '.join(EXTRA_PACKAGES.values())}), and "
          f"{EXTRA_PACKAGES[name.split('.')[0]]} is not installed. Install "
          'it with: pip install "dlion_jax[examples]" (in a clone of the '
          'repository: pip install -e ".[examples]")')
