#![no_main]
//! `stallprof::fuzzing::elf_unwind` on arbitrary bytes: must not panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = stallprof::fuzzing::elf_unwind(data);
});
