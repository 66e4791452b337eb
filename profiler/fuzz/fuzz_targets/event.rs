#![no_main]
//! `stallprof::fuzzing::event` on arbitrary bytes: must not panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = stallprof::fuzzing::event(data);
});
