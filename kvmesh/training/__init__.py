"""Training the library ships as commands: ``kvmesh train-speculator`` (an EAGLE head, ``eagle``, on the
target's own continuations of a corpus, ``eagle_corpus``, from Python's standard library, ``corpus``).
The toy models' scripts stay in ``train/``."""
