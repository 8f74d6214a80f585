// Holds a stream until the host writes a non-zero value to a host-mapped flag, so that the timed
// work queued behind it starts back to back, with no launch gap (nvbench's blocking kernel).
// Gives up after timeout_ns and reports it, so a lost release can never hang the GPU.
extern "C" __global__ void block_stream(const volatile int* flag, int* timed_out, unsigned long long timeout_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (*flag == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) {
            *timed_out = 1;
            return;
        }
    }
}
