"""Stage 1, hash: token ids -> row ids [T, layers, n_hash_cols], integer-exact, on the CPU.

    tables.py     EngramHashTables: multipliers, primes, offsets, token map, pad; the recipes
    reference.py  hash_reference: the hash in plain Python integers (the teaching version)
    cpu.py        EngramHasher: the @njit hasher, with a per-sequence history for decode steps
    tests/        exact tests, property tests and the test vectors of docs/math.md
There is no cuda backend: the hash is a few integer operations per token (4.7 M tokens/s on one
H200 host core), and the pipeline's "cuda" choice for this stage runs the @njit hasher.
"""
