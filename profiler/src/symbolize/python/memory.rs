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

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Fills `buf` from `addr`; a short read is an error (the target unmapped
    /// the range or exited).
    pub fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), PythonError> {
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

    pub fn read_bytes(&self, addr: u64, len: usize) -> Result<Vec<u8>, PythonError> {
        let mut buf = vec![0; len];
        self.read_into(addr, &mut buf)?;
        Ok(buf)
    }

    pub fn read_u64(&self, addr: u64) -> Result<u64, PythonError> {
        let mut b = [0; 8];
        self.read_into(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    pub fn read_u32(&self, addr: u64) -> Result<u32, PythonError> {
        let mut b = [0; 4];
        self.read_into(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    pub fn read_u8(&self, addr: u64) -> Result<u8, PythonError> {
        let mut b = [0; 1];
        self.read_into(addr, &mut b)?;
        Ok(b[0])
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

/// Little-endian field accessors over a block read in one `pread`.
pub(crate) fn le_u64(buf: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(buf[off..off + 8].try_into().expect("8-byte slice"))
}

pub(crate) fn le_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(buf[off..off + 4].try_into().expect("4-byte slice"))
}
