"""The sanitizer session's report reading (CPU) and the session itself (GPU, compute-sanitizer)."""

from __future__ import annotations

import shutil

import pytest

from harness import sanitize

REPORT = """========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "not found" on CUDA API call to cuGetProcAddress.
=========     Saved host backtrace up to driver entry point at error
========= Uninitialized __global__ memory read of size 4 bytes
=========     at dequantize_4bit_kernel+0x1f0
=========     by thread (0,0,0) in block (0,0,0)
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaGetLastError.
========= ERROR SUMMARY: 3 errors
"""


def test_report_counts_kernel_errors_apart_from_host_api_noise():
    assert sanitize.count_errors(REPORT) == {"errors in our kernel": 1, "host API errors": 2}
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitize.count_errors(clean) == {"errors in our kernel": 0, "host API errors": 0}


def test_a_report_without_a_summary_is_not_read_as_clean():
    with pytest.raises(ValueError, match="did not finish"):
        sanitize.count_errors("========= COMPUTE-SANITIZER\nTraceback (most recent call last):\n")


@pytest.mark.gpu
def test_memcheck_and_initcheck_find_nothing_in_our_kernel(bnb, cuda, tmp_path):
    if shutil.which("compute-sanitizer") is None:
        pytest.fail("compute-sanitizer is not on PATH: the CUDA toolkit is incomplete on this GPU machine")
    assert sanitize.main(["--tools=memcheck,initcheck", f"--out={tmp_path}"]) == 0
