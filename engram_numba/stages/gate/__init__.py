"""Stage 4, gate: highway [T, hc, dim] fp32 and kv -> gate [T, hc], highway + gate * value.

    reference.py   gate_reference (numpy, fixed summation order), GateResult, check_eps
    cpu.py         gate_cpu (@njit, the reference's order)
    cuda.py        @cuda.jit kernels gate_v1 (naive, bit-exact) .. gate_v3
    launch.py      prepare_gate / run_gate: the GPU launcher
    records.py     the kernel records of this stage and their default rules
    tests/
"""
