"""Stage 2, rows: row ids -> raw rows (the table's encoding) -> bf16 rows [T*C, 256].

    encodings.py   the table encodings (name, bytes a row, GGUF type): q2k, q3_k, q4_k, q8_0, fp8
    q2k.py         the Q2_K row format: numpy and @njit decoders, and an encoder for fixtures
    kquants.py     Q3_K, Q4_K, Q8_0: numpy and @njit decoders, ggml's Q8_0 encoder
    fp8.py         FP8 rows (e4m3 + e8m0 per 32): decoders, encoder, 264-byte row assembly
    reference.py   gather_reference, rows_reference (numpy)
    cpu.py         rows_cpu (@njit decoders; the host gather is the model's row reader)
    cuda_q2k.py    @cuda.jit decode and gather-by-id kernels, versions q2k_v1..q2k_v4
    cuda_kquants.py, cuda_fp8.py, cuda_common.py
                   the same for q3_k, q4_k, q8_0 and fp8 (v1 naive, v2 8 lanes a row)
    launch.py      decode_rows / gather_rows (+ prepare_*): the GPU launchers
    records.py     the kernel records of this stage
    tests/
Every backend is bit-exact with the reference.
"""
