#![no_main]
//! `stallprof::fuzzing::debug_offsets` on arbitrary bytes: must not panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = stallprof::fuzzing::debug_offsets(data);
});
