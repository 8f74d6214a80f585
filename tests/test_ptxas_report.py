from harness.runtime.ptxas_report import parse_ptxas_log

LOG = """ptxas info    : 0 bytes gmem, 64 bytes cmem[3]
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1088 bytes smem
ptxas info    : Compile time = 3.1 ms
ptxas info    : Compiling entry function 'b' for 'sm_80'
ptxas info    : Function properties for b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 376 bytes cmem[0]
"""


def test_parses_each_entry():
    a, b = parse_ptxas_log(LOG)
    assert (a.kernel, a.arch, a.registers, a.barriers, a.shared_bytes) == ("a", "sm_90", 40, 1, 1088)
    assert (a.stack_frame_bytes, a.spill_store_bytes, a.spill_load_bytes) == (24, 8, 12)
    assert (b.kernel, b.arch, b.registers, b.shared_bytes, b.spill_store_bytes) == ("b", "sm_80", 10, 0, 0)


def test_empty_log_has_no_records():
    assert parse_ptxas_log("") == []
