#![no_main]
//! `stallprof::fuzzing::line_table` on arbitrary bytes: must not panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = stallprof::fuzzing::line_table(data);
});
