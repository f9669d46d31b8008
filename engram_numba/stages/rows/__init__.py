"""Stage 2, rows: row ids -> raw rows (the table's encoding) -> bf16 rows [T*C, 256].

    encodings.py   the table encodings (name, bytes a row, GGUF type)
    q2k.py         the Q2_K row format: numpy and @njit decoders, and an encoder for fixtures
    reference.py   gather_reference, rows_reference (numpy)
    cpu.py         rows_cpu (@njit decoders; the host gather is the model's row reader)
    cuda_q2k.py    @cuda.jit decode and gather-by-id kernels, versions q2k_v1..q2k_v4
    launch.py      decode_rows / gather_rows (+ prepare_*): the GPU launchers
    records.py     the kernel records of this stage
    tests/
Every backend is bit-exact with the reference.
"""
