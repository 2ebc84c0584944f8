"""The indexer's selection rules (`dsv41_jax.model.indexer`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.indexer import select_topk


def test_select_topk_shortcut_and_candidates():
    sc = jnp.asarray([[5.0, 1.0, 3.0, 4.0, 2.0, 0.0]] * 3)
    n_vis = jnp.asarray([2, 5, 6])
    sel = np.asarray(select_topk(sc, n_vis, 3))
    np.testing.assert_array_equal(sel[0], [0, 1, -1])  # <= topk visible: all of them, in order
    assert set(sel[1]) == {0, 3, 2} and set(sel[2]) == {0, 3, 2}
    allowed = jnp.asarray([[False, True, False, True, True, True]] * 3)
    sel = np.asarray(select_topk(sc, n_vis, 3, allowed))
    assert set(sel[1]) == {3, 4, 1}
