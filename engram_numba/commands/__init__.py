"""The commands of `engram-numba` (engram_numba.cli), one module each: its options (`add_parser`)
beside its code (`cmd_*`); `common` holds the argument types and checks they share."""
