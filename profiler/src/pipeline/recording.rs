//! The recording's files: what `record --save-events` writes so that the
//! whole pipeline can run again without the target.
//!
//! In: the raw ring-buffer records as they came ([`EventsWriter`]), what
//! the unwinder read (an [`UnwindBundle`]) and every symbol answer (a
//! [`TableResolver`]). Out: the same, read back ([`read_events`],
//! [`load`]) for `replay`. Three files in the recording's
//! directory: `events.bin.gz` (a magic line, then length-prefixed records),
//! `unwind.json.gz`, `symbols.json`. A recording cut short (the recorder
//! killed) keeps every whole record.
use std::{
    fs,
    io::{BufRead, BufReader, BufWriter, Read, Write},
    path::Path,
};

use anyhow::{Context, Result};
use flate2::{Compression, read::GzDecoder, write::GzEncoder};

use crate::{
    kernel::event,
    os::outdir::{OutDir, PendingFile},
    symbolize::TableResolver,
    unwind::UnwindBundle,
};

/// Files of a saved recording, in its directory.
pub const EVENTS_FILE: &str = "events.bin.gz";
pub const UNWIND_FILE: &str = "unwind.json.gz";
pub const SYMBOLS_FILE: &str = "symbols.json";

/// Magic first line of `events.bin.gz`: format and version (2: stack
/// events carry the running asyncio task; preemptions the `WOKEN` flag).
const EVENTS_MAGIC: &[u8] = b"stallprof-events 2\n";
/// A recorded record longer than this is corrupt (the largest is a stack
/// event, at most ~67 KiB).
const MAX_RECORD: usize = 1 << 20;

type Gz = GzEncoder<BufWriter<PendingFile>>;

/// `events.bin.gz` being written.
pub struct EventsWriter(Gz);

impl EventsWriter {
    pub fn create(dir: &OutDir) -> Result<EventsWriter> {
        let f = dir
            .create(EVENTS_FILE)
            .with_context(|| format!("creating {}", dir.join(EVENTS_FILE).display()))?;
        let mut w = GzEncoder::new(BufWriter::new(f), Compression::fast());
        w.write_all(EVENTS_MAGIC)?;
        Ok(EventsWriter(w))
    }

    /// Append a record: length, then the bytes, a stack event's copy cut
    /// to its valid length.
    pub fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let bytes = &bytes[..event::saved_len(bytes)];
        self.0.write_all(&(bytes.len() as u32).to_le_bytes())?;
        self.0.write_all(bytes)
    }

    pub fn finish(self, dir: &OutDir) -> Result<()> {
        persist(self.0, dir, EVENTS_FILE)
    }
}

fn persist(w: Gz, dir: &OutDir, name: &str) -> Result<()> {
    w.finish()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .persist()
        .with_context(|| format!("writing {}", dir.join(name).display()))
}

/// Write `unwind.json.gz`.
pub fn save_unwind(dir: &OutDir, bundle: &UnwindBundle) -> Result<()> {
    let f = dir
        .create(UNWIND_FILE)
        .with_context(|| format!("creating {}", dir.join(UNWIND_FILE).display()))?;
    let mut w = GzEncoder::new(BufWriter::new(f), Compression::default());
    serde_json::to_writer(&mut w, bundle)?;
    persist(w, dir, UNWIND_FILE)
}

/// Write `symbols.json`.
pub fn save_symbols(dir: &OutDir, table: &TableResolver) -> Result<()> {
    dir.write(SYMBOLS_FILE, &serde_json::to_vec(table)?)
        .with_context(|| format!("writing {}", dir.join(SYMBOLS_FILE).display()))?;
    Ok(())
}

/// What a replay of the recording in `dir` unwinds and names with.
pub fn load(dir: &Path) -> Result<(UnwindBundle, TableResolver)> {
    let path = dir.join(UNWIND_FILE);
    let f = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let bundle: UnwindBundle = serde_json::from_reader(BufReader::new(GzDecoder::new(f)))
        .with_context(|| format!("{} is not an unwind bundle", path.display()))?;
    let path = dir.join(SYMBOLS_FILE);
    let bytes = fs::read(&path).with_context(|| format!("opening {}", path.display()))?;
    let table: TableResolver = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a symbol table", path.display()))?;
    Ok((bundle, table))
}

/// The raw records of the recording in `dir`, in order.
pub fn read_events(dir: &Path) -> Result<Vec<Vec<u8>>> {
    let path = dir.join(EVENTS_FILE);
    let f = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut r = BufReader::new(GzDecoder::new(f));
    let mut magic = Vec::new();
    r.read_until(b'\n', &mut magic)?;
    if magic != EVENTS_MAGIC {
        anyhow::bail!(
            "{} is not a stallprof recording of this version (it starts {:?})",
            path.display(),
            String::from_utf8_lossy(&magic[..magic.len().min(40)])
        );
    }
    let mut out = Vec::new();
    loop {
        let mut len = [0u8; 4];
        match r.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_RECORD {
            anyhow::bail!(
                "{}: record {} is {len} bytes long: corrupt",
                path.display(),
                out.len()
            );
        }
        let mut rec = vec![0u8; len];
        match r.read_exact(&mut rec) {
            Ok(()) => out.push(rec),
            // A recording cut short (the recorder was killed): keep what is whole.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }
    Ok(out)
}
