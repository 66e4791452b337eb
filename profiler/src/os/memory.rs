//! Read-only access to another process's memory through `/proc/PID/mem`:
//! the one reader of a target's memory (CPython's state, V8's heap, the
//! vDSO image of this process).
//!
//! In: a pid and addresses; or bytes captured from the target at an
//! instant ([`CapturedRead`], what BPF read with a stack), served in place of
//! the live memory ([`Overlay`]). Out: bytes and little-endian integers,
//! or a [`MemoryError`] naming the process, the address and the length.
//! No ptrace and no stopping the target: reads race with the running
//! process, so every caller treats what it reads as untrusted (bounded
//! loops, size caps, re-checks). Each read is one `pread` (more only when
//! the kernel returns less); nothing is cached here. Needs root or
//! `CAP_SYS_PTRACE` (or the same uid and a permissive
//! `kernel.yama.ptrace_scope`).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Why the target's memory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("process {pid} not found: it exited, or the pid is wrong")]
    NoSuchProcess { pid: u32 },
    #[error(
        "permission denied reading {} of process {pid}: reading another user's process needs CAP_SYS_PTRACE (and kernel.yama.ptrace_scope below 3)",
        path.display()
    )]
    PermissionDenied { pid: u32, path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot read {len} bytes at {addr:#x} in process {pid}: {source} \
         (the process exited or unmapped that memory; retry while it runs)"
    )]
    Read {
        pid: u32,
        addr: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
}

/// Bytes read from the target at some instant: where, and what. A trait,
/// so that this bottom room knows nothing of the kernel's event types
/// (`kernel::event::MemoryRead` implements it, in the Python task reader).
pub trait CapturedRead {
    fn addr(&self) -> u64;
    fn bytes(&self) -> &[u8];
}

/// A `pread` reader over `/proc/PID/mem`.
#[derive(Debug)]
pub struct ProcessMemory {
    pid: u32,
    file: File,
}

impl ProcessMemory {
    pub fn open(pid: u32) -> Result<Self, MemoryError> {
        let path = PathBuf::from(format!("/proc/{pid}/mem"));
        let file = File::open(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => MemoryError::NoSuchProcess { pid },
            io::ErrorKind::PermissionDenied => MemoryError::PermissionDenied { pid, path },
            _ => MemoryError::Open { path, source: e },
        })?;
        Ok(Self { pid, file })
    }

    fn pread(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
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

    fn read_error(&self, addr: u64, len: usize, source: io::Error) -> MemoryError {
        MemoryError::Read {
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
    fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError>;

    fn read_bytes(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        let mut buf = vec![0; len];
        self.read_into(addr, &mut buf)?;
        Ok(buf)
    }

    fn read_u64(&self, addr: u64) -> Result<u64, MemoryError> {
        let mut b = [0; 8];
        self.read_into(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn read_u32(&self, addr: u64) -> Result<u32, MemoryError> {
        let mut b = [0; 4];
        self.read_into(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn read_u8(&self, addr: u64) -> Result<u8, MemoryError> {
        let mut b = [0; 1];
        self.read_into(addr, &mut b)?;
        Ok(b[0])
    }

    /// A C string at `addr`, without its NUL, at most `cap` bytes. Read up
    /// to the end of its page first (a short string before an unmapped
    /// page does not fail), then, when no NUL came yet, the rest.
    fn read_c_str(&self, addr: u64, cap: usize) -> Result<Vec<u8>, MemoryError> {
        let first = cap.min((PAGE - addr % PAGE) as usize);
        let mut b = self.read_bytes(addr, first)?;
        if let Some(end) = b.iter().position(|&c| c == 0) {
            b.truncate(end);
            return Ok(b);
        }
        if first < cap {
            let more = self.read_bytes(addr + first as u64, cap - first)?;
            let end = more.iter().position(|&c| c == 0).unwrap_or(more.len());
            b.extend_from_slice(&more[..end]);
        }
        Ok(b)
    }
}

/// The page size reads are split at ([`ReadMemory::read_c_str`]): x86-64's.
const PAGE: u64 = 4096;

impl ReadMemory for ProcessMemory {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.pread(addr, buf)
    }
}

/// The live process, seen through what BPF read of it with a stack
/// (`Event::Task`): a read wholly inside one of `reads` is served from it
/// (the memory as it was then, though the object may be freed since);
/// any other goes to the process.
pub struct Overlay<'a, C> {
    pub live: &'a ProcessMemory,
    pub reads: &'a [C],
}

impl<C: CapturedRead> ReadMemory for Overlay<'_, C> {
    fn pid(&self) -> u32 {
        self.live.pid
    }

    fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let end = addr.checked_add(buf.len() as u64);
        for r in self.reads {
            let (r_addr, r_bytes) = (r.addr(), r.bytes());
            let r_end = r_addr.checked_add(r_bytes.len() as u64);
            if addr >= r_addr && end.zip(r_end).is_some_and(|(e, r_end)| e <= r_end) {
                let at = (addr - r_addr) as usize;
                buf.copy_from_slice(&r_bytes[at..at + buf.len()]);
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

    struct MemoryRead {
        addr: u64,
        bytes: Vec<u8>,
    }

    impl CapturedRead for MemoryRead {
        fn addr(&self) -> u64 {
            self.addr
        }
        fn bytes(&self) -> &[u8] {
            &self.bytes
        }
    }

    #[test]
    fn c_strings_cross_pages_and_stop_before_unmapped_ones() {
        let live = ProcessMemory::open(std::process::id()).unwrap();
        let page = PAGE as usize;
        // SAFETY: a private anonymous mapping of our own, unmapped below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let bytes = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, 2 * page) };
        let name = b"_contextvars.ContextVar\0";
        // Across the two pages: 9 bytes on the first.
        let at = page - 9;
        bytes[at..at + name.len()].copy_from_slice(name);
        let addr = base as u64 + at as u64;
        assert_eq!(
            live.read_c_str(addr, 32).unwrap(),
            b"_contextvars.ContextVar"
        );
        assert_eq!(live.read_c_str(addr, 5).unwrap(), b"_cont");
        // At the end of the first page, the second one unmapped.
        bytes[page - 4..page].copy_from_slice(b"set\0");
        unsafe { libc::munmap((base as usize + page) as *mut libc::c_void, page) };
        assert_eq!(
            live.read_c_str(base as u64 + page as u64 - 4, 32).unwrap(),
            b"set"
        );
        // No NUL before the unmapped page: the read fails, never a guess.
        bytes[page - 2..page].copy_from_slice(b"xy");
        assert!(live.read_c_str(base as u64 + page as u64 - 2, 32).is_err());
        unsafe { libc::munmap(base, page) };
    }

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
