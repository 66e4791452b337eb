#![no_main]
//! `stallprof::fuzzing::perf_map` on arbitrary bytes: must not panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = stallprof::fuzzing::perf_map(data);
});
