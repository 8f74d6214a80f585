"""The correctness harness: the CPU reference, bit comparison, the case matrix and shapes, the
end-to-end QLoRA factory, peer implementations and the sanitizer session."""
