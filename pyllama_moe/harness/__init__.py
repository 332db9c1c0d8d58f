"""The identity harness: the matrix, runs of a model on a build, the cached models, compare, the server soak."""
