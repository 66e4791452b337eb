//! The agent's own heap: how glibc's allocator is set up, and when freed
//! memory goes back to the kernel.
//!
//! In: nothing; called once at start ([`tune`]) and after phases that free a
//! lot ([`release`]: the probes' load, the symbolizer letting go of parsed
//! files). Out: a smaller peak RSS (`VmHWM`), which is what an operator sees.
//!
//! glibc keeps what is freed for reuse: a thread's allocations live in that
//! thread's arena (the drain's tokio thread, the symbolizer thread), and a
//! free from another thread goes back to the owner's arena, where only that
//! thread reuses it. Measured on the demo (`cargo xtask demo`, docs/
//! benchmarks.md §3): one arena cut the peak by ~18 MiB; trimming after the
//! load cut the idle heap from 21 to 3 MiB (the kernel BTF parsed at load is
//! freed at once, but stayed resident). stallprof allocates little per
//! event, so one arena's lock costs nothing measurable.

/// One malloc arena for every thread, and free memory at the top of the heap
/// above 1 MiB returned to the kernel at once. Call before other threads
/// start.
pub fn tune() {
    // SAFETY: mallopt only changes allocator parameters; called from main
    // before any other thread exists.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
}

/// Return the heap's free pages to the kernel (after a phase that freed a
/// lot: what glibc keeps is resident until reused).
pub fn release() {
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}
