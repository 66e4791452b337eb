#![no_main]
//! `stallprof::fuzzing::proc_text` on arbitrary bytes: must not panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = stallprof::fuzzing::proc_text(data);
});
