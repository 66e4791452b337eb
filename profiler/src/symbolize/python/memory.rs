//! Read-only access to another process's memory through `/proc/PID/mem`.
//!
//! In: a pid and addresses. Out: bytes and little-endian integers. No ptrace
//! and no stopping the target: reads race with the running process, so every
//! caller treats what it reads as untrusted (bounded loops, size caps,
//! re-checks). Needs root or `CAP_SYS_PTRACE` (or the same uid and a
//! permissive `kernel.yama.ptrace_scope`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::PythonError;
use crate::kernel::event::MemoryRead;

/// A `pread` reader over `/proc/PID/mem`.
#[derive(Debug)]
pub struct ProcessMemory {
    pid: u32,
    file: File,
}

impl ProcessMemory {
    pub fn open(pid: u32) -> Result<Self, PythonError> {
        let path = PathBuf::from(format!("/proc/{pid}/mem"));
        let file = File::open(&path).map_err(|e| PythonError::open(pid, path, e))?;
        Ok(Self { pid, file })
    }

    fn pread(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], addr + done as u64) {
                Ok(0) => {
                    return Err(self.read_error(
                        addr,
                        buf.len(),
                        io::Error::from(io::ErrorKind::UnexpectedEof),
                    ));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.read_error(addr, buf.len(), e)),
            }
        }
        Ok(())
    }

    fn read_error(&self, addr: u64, len: usize, source: io::Error) -> PythonError {
        PythonError::Read {
            pid: self.pid,
            addr,
            len,
            source,
        }
    }
}

/// Reads of a target's memory: the live process ([`ProcessMemory`]) or
/// what BPF read of it at an instant ([`Overlay`]).
pub trait ReadMemory {
    fn pid(&self) -> u32;

    /// Fills `buf` from `addr`; a short read is an error (the target
    /// unmapped the range or exited).
    fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError>;

    fn read_bytes(&self, addr: u64, len: usize) -> Result<Vec<u8>, PythonError> {
        let mut buf = vec![0; len];
        self.read_into(addr, &mut buf)?;
        Ok(buf)
    }

    fn read_u64(&self, addr: u64) -> Result<u64, PythonError> {
        let mut b = [0; 8];
        self.read_into(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn read_u32(&self, addr: u64) -> Result<u32, PythonError> {
        let mut b = [0; 4];
        self.read_into(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn read_u8(&self, addr: u64) -> Result<u8, PythonError> {
        let mut b = [0; 1];
        self.read_into(addr, &mut b)?;
        Ok(b[0])
    }
}

impl ReadMemory for ProcessMemory {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError> {
        self.pread(addr, buf)
    }
}

/// The live process, seen through what BPF read of it with a stack
/// (`Event::Task`): a read wholly inside one of `reads` is served from it
/// (the memory as it was then, though the object may be freed since);
/// any other goes to the process.
pub struct Overlay<'a> {
    pub live: &'a ProcessMemory,
    pub reads: &'a [MemoryRead],
}

impl ReadMemory for Overlay<'_> {
    fn pid(&self) -> u32 {
        self.live.pid
    }

    fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError> {
        let end = addr.checked_add(buf.len() as u64);
        for r in self.reads {
            let r_end = r.addr.checked_add(r.bytes.len() as u64);
            if addr >= r.addr && end.zip(r_end).is_some_and(|(e, r_end)| e <= r_end) {
                let at = (addr - r.addr) as usize;
                buf.copy_from_slice(&r.bytes[at..at + buf.len()]);
                return Ok(());
            }
        }
        self.live.pread(addr, buf)
    }
}

/// Little-endian field accessors over a block read in one `pread`.
pub(crate) fn le_u64(buf: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(buf[off..off + 8].try_into().expect("8-byte slice"))
}

pub(crate) fn le_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(buf[off..off + 4].try_into().expect("4-byte slice"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_serves_whole_reads_inside_a_part_and_sends_the_rest_to_the_process() {
        let live = ProcessMemory::open(std::process::id()).unwrap();
        let here: u64 = 0x1122_3344_5566_7788;
        let at = &here as *const u64 as u64;
        let reads = [MemoryRead {
            addr: 0x1000,
            bytes: (0u8..16).collect(),
        }];
        let o = Overlay {
            live: &live,
            reads: &reads,
        };
        assert_eq!(o.read_u64(0x1000).unwrap(), 0x0706_0504_0302_0100);
        assert_eq!(o.read_u64(0x1008).unwrap(), 0x0f0e_0d0c_0b0a_0908);
        assert_eq!(o.read_u8(0x100f).unwrap(), 15);
        // Past the part's end, or straddling it: not from the part.
        assert!(o.read_u64(0x1009).is_err());
        assert!(o.read_u64(0xffc).is_err());
        assert_eq!(o.read_u64(at).unwrap(), here);
        assert!(o.read_u64(u64::MAX - 3).is_err());
        let top = [MemoryRead {
            addr: u64::MAX - 3,
            bytes: vec![0; 16],
        }];
        let o = Overlay {
            live: &live,
            reads: &top,
        };
        assert!(o.read_u8(u64::MAX - 1).is_err());
    }
}
