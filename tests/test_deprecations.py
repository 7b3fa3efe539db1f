"""Names moved or renamed warn at their old place and give the new
object (the optax way: one import path per name, the old one for a
release)."""

import pytest

import dlion_jax as dl

MOVED = [
    ("message", name, "strategies", name) for name in (
        "psum_radix", "mavo_has_ties", "alltoall_down_radix",
        "int_container", "signed_sum")] + [
    ("exchange", name, "strategies", name) for name in (
        "exchange_alltoall", "exchange_allgather", "exchange_psum",
        "exchange_psum_int8")] + [
    ("exchange", "axis_size", "exchange", "workers_along")]


@pytest.mark.parametrize("old_module,old,new_module,new", MOVED,
                         ids=lambda x: x)
def test_an_old_path_warns_and_gives_the_new_object(old_module, old,
                                                    new_module, new):
  with pytest.warns(DeprecationWarning,
                    match=rf"use dlion_jax\.{new_module}\.{new} "):
    found = getattr(getattr(dl, old_module), old)
  assert found is getattr(getattr(dl, new_module), new)


def test_an_unknown_name_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    dl.exchange.nothing  # pylint: disable=pointless-statement
