//! Entry points for the fuzz targets (`profiler/fuzz/`, `cargo fuzz`) and
//! the random-input tests: every parser of bytes the target controls, fed
//! arbitrary input. Each must return without panicking, in time linear in
//! its input, and allocate no more than its caps allow. Not an API.

/// A Python code object's `co_linetable` (3.10 and 3.11+ formats); the
/// first 8 bytes choose `co_firstlineno` and the looked-up addresses.
pub fn line_table(data: &[u8]) -> usize {
    let (head, table) = data.split_at(data.len().min(8));
    let mut h = [0u8; 8];
    h[..head.len()].copy_from_slice(head);
    let first_line = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let addr = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    crate::symbolize::python::fuzz_line_table(table, first_line, &[0, addr, addr / 2, u32::MAX])
}

/// `/tmp/perf-PID.map` bytes, fed in pieces the first byte chooses (as a
/// growing file is read), then looked up.
pub fn perf_map(data: &[u8]) -> usize {
    let Some((&piece, rest)) = data.split_first() else {
        return 0;
    };
    let addrs = [0, 0x1000, 0x7fff_0000_0000, u64::MAX];
    crate::symbolize::fuzz_perf_map(rest, usize::from(piece) + 1, &addrs)
}

/// An ELF file: unwind info parsed as from a mapped file, its CFI scanned
/// and frames unwound through it; and named symbols read from it as V8's
/// metadata, `_PyRuntime` and tokio's park functions are
/// (`os::elf_symbols`).
pub fn elf_unwind(data: &[u8]) {
    crate::unwind::fuzz_elf_unwind(data);
    crate::os::elf_symbols::fuzz(data);
}

/// A ring-buffer record as the kernel sends it (the target shapes its
/// contents: stack copies, Python frame records, names).
pub fn event(data: &[u8]) {
    let _ = crate::kernel::event::parse(data);
}

/// `/proc` text formats: `maps` (parsed by `os::maps`, then looked up as
/// the symbolizer does and filtered as the unwinder does), `status` lines
/// (`NSpid:`) and `cgroup` (the container it names).
pub fn proc_text(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let addr = data
        .iter()
        .take(8)
        .fold(0u64, |a, &b| a << 8 | u64::from(b));
    let _ = crate::os::maps::parse(&text);
    let _ = crate::symbolize::fuzz_maps(&text, addr);
    let _ = crate::unwind::fuzz_maps(&text);
    let _ = crate::os::proc::innermost_nspid(&text);
    let _ = crate::os::container::from_cgroup(&text);
}

/// The `_PyRuntime` block a CPython 3.13+ reads its `_Py_DebugOffsets`
/// from.
pub fn debug_offsets(data: &[u8]) {
    crate::symbolize::python::fuzz_debug_offsets(data);
}

#[cfg(test)]
mod tests {
    //! Random and mutated inputs for every parser, a bounded run in the unit
    //! tests (the fuzz targets run longer in `cargo xtask test`).

    /// xorshift64*: reproducible without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn bytes(&mut self, seed: &[u8], max: usize) -> Vec<u8> {
            let mut v = seed.to_vec();
            let n = (self.next() % max as u64) as usize;
            if v.is_empty() || self.next().is_multiple_of(4) {
                v = (0..n).map(|_| self.next() as u8).collect();
            } else {
                for _ in 0..1 + self.next() % 16 {
                    let i = (self.next() % v.len() as u64) as usize;
                    v[i] = self.next() as u8;
                }
            }
            v
        }
    }

    #[test]
    fn parsers_survive_random_input() {
        let own_exe = std::fs::read("/proc/self/exe").unwrap_or_default();
        // The first 64 KiB of a real ELF: headers and sections are there,
        // the section data mostly cut off.
        let elf = &own_exe[..own_exe.len().min(64 << 10)];
        let maps = std::fs::read("/proc/self/maps").unwrap_or_default();
        let status = std::fs::read("/proc/self/status").unwrap_or_default();
        let cgroup = b"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod8e1f0c2a_3b4d_4e5f_9a6b_7c8d9e0f1a2b.slice/cri-containerd-3f2a9c0b1d4e5f60718293a4b5c6d7e8f90123456789abcdef0123456789abcd.scope\n3:cpu:/docker/3f2a9c0b1d4e5f60718293a4b5c6d7e8f90123456789abcdef0123456789abcd\n".to_vec();
        let perf = b"7f0000001000 40 LazyCompile:~main app.js:1\n7f0000002000 10 x\n".to_vec();
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        for _ in 0..3000 {
            super::line_table(&rng.bytes(&[], 512));
            super::perf_map(&rng.bytes(&perf, 512));
            super::event(&rng.bytes(&[], 2048));
            super::proc_text(&rng.bytes(&maps, 4096));
            super::proc_text(&rng.bytes(&status, 2048));
            super::proc_text(&rng.bytes(&cgroup, 1024));
            super::debug_offsets(&rng.bytes(&[], 2048));
        }
        for _ in 0..200 {
            super::elf_unwind(&rng.bytes(elf, 4096));
        }
        super::elf_unwind(elf);
    }
}
