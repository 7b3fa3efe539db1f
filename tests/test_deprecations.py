"""Names moved or renamed warn at their old place and give the new
object (the optax way: one import path per name, the old one for a
release)."""

import importlib
import types

import pytest

import dlion_jax as dl

MOVED = [
    ("message", name, "strategies", name) for name in (
        "psum_radix", "mavo_has_ties", "alltoall_down_radix",
        "int_container", "signed_sum")] + [
    ("exchange", name, "strategies", name) for name in (
        "exchange_alltoall", "exchange_allgather", "exchange_psum",
        "exchange_psum_int8")] + [
    ("exchange", "axis_size", "exchange", "workers_along")] + [
    ("parallel", name, "devices", name) for name in (
        "data_mesh", "global_array", "hybrid_mesh", "replicate",
        "replicate_for_pmap", "shard_batch", "shard_params",
        "stack_for_workers", "use_cpu_devices")] + [
    ("parallel", name, "transforms", name) for name in (
        "apply_if_finite", "pmean_gradients")] + [
    ("accounting", name, "hlo", name) for name in (
        "Collective", "collective_bytes", "collectives")] + [
    ("accounting", name, "message", name) for name in (
        "AGGREGATIONS", "COMMS", "message_bytes", "message_radix",
        "message_word_multiple", "vote_bits")] + [
    ("accounting", name, "quantize", name) for name in (
        "PBIT_RANGE", "QUANTIZERS", "VOTES", "VoteSpec", "vote_spec")] + [
    ("accounting", name, "strategies", name) for name in (
        "alltoall_down_radix", "int_container", "mavo_has_ties",
        "psum_radix")] + [
    ("bench", "use_cpu_devices", "devices", "use_cpu_devices")]


@pytest.mark.parametrize("old_module,old,new_module,new", MOVED,
                         ids=lambda x: x)
def test_an_old_path_warns_and_gives_the_new_object(old_module, old,
                                                    new_module, new):
  with pytest.warns(DeprecationWarning,
                    match=rf"use dlion_jax\.{new_module}\.{new} "):
    found = getattr(importlib.import_module(f"dlion_jax.{old_module}"), old)
  assert found is getattr(getattr(dl, new_module), new)


def test_an_unknown_name_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    dl.exchange.nothing  # pylint: disable=pointless-statement


PUBLIC_MODULES = [m for m in vars(dl).values()
                  if isinstance(m, types.ModuleType)
                  and m.__name__.startswith("dlion_jax.")
                  and not m.__name__.split(".")[-1].startswith("_")] + [
    importlib.import_module(f"dlion_jax.{name}")
    for name in ("bench", "lion", "processes", "shards")]


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
def test_a_public_module_defines_its_names_or_imports_them_privately(module):
  """One import path per name: a public module's public functions and
  classes are its own or come from a private module (``dl.<name>`` at the
  top is the optax-style short path, not a second home)."""
  elsewhere = {
      name: obj.__module__ for name, obj in vars(module).items()
      if not name.startswith("_") and not isinstance(obj, types.ModuleType)
      and getattr(obj, "__module__", "").startswith("dlion_jax")
      and obj.__module__ != module.__name__
      and not obj.__module__.split(".")[-1].startswith("_")}
  assert not elsewhere, f"{module.__name__} re-exports {elsewhere}"
