"""The test harness's own guard: workers give back the memory mappings of unused executables."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.conftest import MAPPINGS_HIGH, memory_mappings, release_unused_executables


def test_unused_executables_give_back_their_mappings():
    """Compiling programs takes mappings until JAX's caches drop them; the guard drops them
    only past its threshold (control: below it nothing is dropped)."""
    assert 0 < MAPPINGS_HIGH < 65530
    before = memory_mappings()
    for i in range(60):
        jax.jit(lambda x, i=i: jnp.sin(x) * i)(jnp.ones((i + 1,))).block_until_ready()
    grown = memory_mappings()
    assert grown > before + 60, (before, grown)
    assert not release_unused_executables(grown + 1000)  # below the threshold: kept
    assert memory_mappings() >= grown - 10
    assert release_unused_executables(0)
    assert memory_mappings() < grown - 60, (grown, memory_mappings())
