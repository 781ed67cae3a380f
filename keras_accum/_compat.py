"""Private Keras names, each behind one small function.

Each says what it is for and on which Keras versions it was checked.
"""

# remat


# The mask Keras attached to a tensor, for `Rematerialized`; checked on Keras 3.10-3.15.
def keras_mask(x):
    """The mask of `x` (from `Embedding(mask_zero=True)`, `Masking`, ...) or
    None: `Rematerialized` passes it to its layer explicitly, as Keras's
    `Layer.__call__` does, so that the recomputation sees it too."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(x)
