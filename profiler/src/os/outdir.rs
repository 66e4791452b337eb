//! Output directories that a planted symlink cannot redirect.
//!
//! In: a path the user (or the daemon's config) named. Out: an [`OutDir`],
//! the directory opened once (`O_DIRECTORY | O_NOFOLLOW`), and files created
//! relative to that descriptor only.
//!
//! stallprof runs as root and writes where it is told, often into a
//! directory other users can reach. Every file is therefore created under a
//! random temporary name with `openat(O_CREAT | O_EXCL | O_NOFOLLOW)` (a name
//! that already exists, symlink or not, is never opened), written, fsynced
//! and `renameat`-ed onto its final name (which replaces a planted symlink
//! instead of following it). There is no write-test probe file: creating the
//! first temporary file is the test. A directory that already exists is used
//! only if the invoking user (`SUDO_UID` under sudo) or root owns it and no
//! one else may write to it; a new one is created 0700 with `mkdirat`, whose
//! last component is never a followed symlink. Its parents are walked one
//! component at a time (missing ones made 0700, like `mkdir -p`); a symlink
//! on the way is followed only if root or the invoking user owns it. Files are 0600, or 0640 with
//! a reader group (the daemon's `data_group`). Under sudo, what is created
//! is handed to the invoking user, who can then read and delete it.
use std::{
    fs::File,
    io::{self, Write},
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    os::unix::ffi::OsStringExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use rustix::fs::{
    AtFlags, CWD, FileType, Mode, OFlags, fchown, fstat, fsync, mkdirat, openat, readlinkat,
    renameat, statat, unlinkat,
};
use rustix::process::{Gid, Uid};
use thiserror::Error;

use crate::os::user;

#[derive(Debug, Error)]
pub enum OutDirError {
    #[error(
        "{path} is a symlink; stallprof never writes through one: give the real directory with -o DIR"
    )]
    Symlink { path: PathBuf },
    #[error(
        "{path} belongs to uid {owner}, not to you (uid {you}): stallprof writes only into a directory you own; \
         give a new directory with -o DIR"
    )]
    NotOwned { path: PathBuf, owner: u32, you: u32 },
    #[error(
        "{path} is writable by others (mode {mode:o}): files there could be swapped under stallprof; \
         give a new directory with -o DIR (or chmod go-w it)"
    )]
    Writable { path: PathBuf, mode: u32 },
    #[error(
        "{link:?}, on the way to {path}, is a symlink owned by uid {owner} (neither you nor root): \
         stallprof does not follow another user's link; give the real path with -o DIR"
    )]
    ForeignLink {
        path: PathBuf,
        link: PathBuf,
        owner: u32,
    },
    #[error("{path} already exists: give a new directory with -o DIR")]
    Exists { path: PathBuf },
    #[error(
        "cannot create or open the directory {path}: {source}; choose a writable directory with -o DIR"
    )]
    Open { path: PathBuf, source: io::Error },
}

/// Who may read what an [`OutDir`] creates, and who owns it.
#[derive(Debug, Clone, Copy)]
struct Access {
    /// Files and directories created are handed to this user and group (the
    /// invoking user under sudo); `None`: they stay the process's.
    owner: Option<(u32, u32)>,
    /// A group that may read (the daemon's `data_group`).
    reader_group: Option<u32>,
}

impl Access {
    fn file_mode(&self) -> Mode {
        Mode::from_raw_mode(if self.reader_group.is_some() {
            0o640
        } else {
            0o600
        })
    }

    fn dir_mode(&self) -> Mode {
        Mode::from_raw_mode(if self.reader_group.is_some() {
            0o750
        } else {
            0o700
        })
    }

    /// Hand a freshly created file or directory to its owner and group.
    fn apply(&self, fd: impl AsFd) -> io::Result<()> {
        let uid = self.owner.map(|(u, _)| Uid::from_raw(u));
        let gid = self
            .reader_group
            .or(self.owner.map(|(_, g)| g))
            .map(Gid::from_raw);
        if uid.is_some() || gid.is_some() {
            fchown(fd.as_fd(), uid, gid)?;
        }
        Ok(())
    }
}

/// An opened output directory; cheap to clone (one shared descriptor).
#[derive(Debug, Clone)]
pub struct OutDir {
    fd: Arc<OwnedFd>,
    path: PathBuf,
    access: Access,
}

/// Eight random bytes as hex: an unguessable name part.
pub fn random_suffix() -> String {
    let mut b = [0u8; 8];
    fill_random(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Fill `b` from the kernel's random source (getrandom(2)).
pub fn fill_random(b: &mut [u8]) {
    let mut filled = 0;
    while filled < b.len() {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            // getrandom(2) exists since Linux 3.17, far below our BPF floor.
            Err(e) => panic!("getrandom: {e}"),
        }
    }
}

fn split(path: &Path) -> (Option<&Path>, &std::ffi::OsStr) {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    (parent, path.file_name().unwrap_or(path.as_os_str()))
}

/// Symlinks followed on the way to an output directory, as the kernel's
/// own `MAXSYMLINKS`.
const MAX_LINK_HOPS: usize = 40;

/// Opens the parent directories of `path` component by component (from `/`
/// or the working directory), creating missing ones like `mkdir -p` but
/// 0700 and handed to the invoking user. A symlink on the way is followed
/// only if root or the invoking user owns it: a link another user planted
/// in a shared directory (`/tmp/shared/out -> /etc`) is refused, as the
/// kernel's `protected_symlinks` would in a sticky directory.
fn open_parent(path: &Path, access: Access) -> Result<Option<OwnedFd>, OutDirError> {
    use std::collections::VecDeque;
    use std::path::Component;
    let (parent, _) = split(path);
    let Some(parent) = parent else {
        return Ok(None);
    };
    let err = |e: rustix::io::Errno| OutDirError::Open {
        path: path.to_path_buf(),
        source: e.into(),
    };
    let dir_flags = OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::RDONLY;
    let open_dir = |at: BorrowedFd<'_>, name: &std::ffi::OsStr| {
        openat(at, name, dir_flags | OFlags::NOFOLLOW, Mode::empty())
    };
    let euid = rustix::process::geteuid().as_raw();
    let you = access.owner.map(|(u, _)| u).unwrap_or(euid);
    let mut todo: VecDeque<std::ffi::OsString> = parent
        .components()
        .map(|c| c.as_os_str().to_os_string())
        .collect();
    let mut fd = openat(CWD, ".", dir_flags, Mode::empty()).map_err(err)?;
    let mut hops = 0;
    while let Some(part) = todo.pop_front() {
        let name = part.as_os_str();
        match Path::new(name).components().next() {
            Some(Component::RootDir) => {
                fd = openat(CWD, "/", dir_flags, Mode::empty()).map_err(err)?;
                continue;
            }
            Some(Component::CurDir) | None => continue,
            _ => {}
        }
        match open_dir(fd.as_fd(), name) {
            Ok(next) => fd = next,
            Err(rustix::io::Errno::NOENT) => {
                match mkdirat(&fd, name, access.dir_mode()) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(err(e)),
                }
                let next = open_dir(fd.as_fd(), name).map_err(err)?;
                if fstat(&next).map_err(err)?.st_uid == euid {
                    access.apply(&next).map_err(|source| OutDirError::Open {
                        path: path.to_path_buf(),
                        source,
                    })?;
                }
                fd = next;
            }
            Err(e @ (rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR)) => {
                let st = statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW).map_err(err)?;
                if FileType::from_raw_mode(st.st_mode) != FileType::Symlink {
                    return Err(err(e));
                }
                if st.st_uid != 0 && st.st_uid != you {
                    return Err(OutDirError::ForeignLink {
                        path: path.to_path_buf(),
                        link: name.into(),
                        owner: st.st_uid,
                    });
                }
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return Err(err(rustix::io::Errno::LOOP));
                }
                let target = readlinkat(&fd, name, Vec::new()).map_err(err)?;
                let target = PathBuf::from(std::ffi::OsString::from_vec(target.into_bytes()));
                for c in target.components().rev() {
                    todo.push_front(c.as_os_str().to_os_string());
                }
            }
            Err(e) => return Err(err(e)),
        }
    }
    Ok(Some(fd))
}

impl OutDir {
    fn access() -> Access {
        Access {
            owner: user::sudo_invoker().map(|u| (u.uid, u.gid)),
            reader_group: None,
        }
    }

    /// A directory that must not exist yet (the default, randomly named
    /// outputs): created 0700.
    pub fn create_new(path: &Path) -> Result<OutDir, OutDirError> {
        Self::open(path, true, Self::access())
    }

    /// `path`, created 0700 if missing; if it exists it must be a real
    /// directory (not a symlink), owned by the invoking user or root, and
    /// not writable by group or others.
    pub fn open_or_create(path: &Path) -> Result<OutDir, OutDirError> {
        Self::open(path, false, Self::access())
    }

    /// Like [`OutDir::open_or_create`], for a root service whose files a
    /// group may read (the daemon's `data_group`): files 0640, directories
    /// 0750, both in that group.
    pub fn open_or_create_shared(path: &Path, group: Option<u32>) -> Result<OutDir, OutDirError> {
        Self::open(
            path,
            false,
            Access {
                owner: None,
                reader_group: group,
            },
        )
    }

    fn open(path: &Path, must_be_new: bool, access: Access) -> Result<OutDir, OutDirError> {
        let err = |e: rustix::io::Errno| OutDirError::Open {
            path: path.to_path_buf(),
            source: e.into(),
        };
        let parent = open_parent(path, access)?;
        let (_, name) = split(path);
        let at = parent.as_ref().map(|p| p.as_fd()).unwrap_or(CWD);
        let created = match mkdirat(at, name, access.dir_mode()) {
            Ok(()) => true,
            Err(rustix::io::Errno::EXIST) if !must_be_new => false,
            Err(rustix::io::Errno::EXIST) => {
                return Err(OutDirError::Exists {
                    path: path.to_path_buf(),
                });
            }
            Err(e) => return Err(err(e)),
        };
        let fd = match openat(
            at,
            name,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::RDONLY,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::LOOP) | Err(rustix::io::Errno::NOTDIR)
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) =>
            {
                return Err(OutDirError::Symlink {
                    path: path.to_path_buf(),
                });
            }
            Err(e) => return Err(err(e)),
        };
        // Checked on what was opened, also when just created: a directory
        // swapped in between mkdirat and openat fails here.
        let st = fstat(&fd).map_err(err)?;
        let euid = rustix::process::geteuid().as_raw();
        let you = access.owner.map(|(u, _)| u).unwrap_or(euid);
        if st.st_uid != you && st.st_uid != euid {
            return Err(OutDirError::NotOwned {
                path: path.to_path_buf(),
                owner: st.st_uid,
                you,
            });
        }
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 {
            return Err(OutDirError::Writable {
                path: path.to_path_buf(),
                mode,
            });
        }
        if created {
            access.apply(&fd).map_err(|source| OutDirError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        }
        Ok(OutDir {
            fd: Arc::new(fd),
            path: path.to_path_buf(),
            access,
        })
    }

    /// A new subdirectory `name` (the daemon's windows); `Ok(None)` when
    /// the name is taken.
    pub fn subdir_new(&self, name: &str) -> io::Result<Option<OutDir>> {
        match mkdirat(&*self.fd, name, self.access.dir_mode()) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let fd = openat(
            &*self.fd,
            name,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::RDONLY,
            Mode::empty(),
        )?;
        self.access.apply(&fd)?;
        Ok(Some(OutDir {
            fd: Arc::new(fd),
            path: self.path.join(name),
            access: self.access,
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The opened directory, for reads relative to it (the daemon's
    /// `/reports/`, which must not leave it).
    pub fn dir_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The path `name` will have once written (for messages and listings).
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// A new file that becomes `name` on [`PendingFile::persist`]; until
    /// then it has a random name, and dropping it removes it.
    pub fn create(&self, name: &str) -> io::Result<PendingFile> {
        for _ in 0..8 {
            let tmp = format!(".{name}.{}.tmp", random_suffix());
            match openat(
                &*self.fd,
                tmp.as_str(),
                OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::WRONLY,
                self.access.file_mode(),
            ) {
                Ok(fd) => {
                    let pending = PendingFile {
                        file: File::from(fd),
                        dir: self.fd.clone(),
                        tmp,
                        name: name.to_string(),
                        persisted: false,
                    };
                    self.access.apply(&pending.file)?;
                    return Ok(pending);
                }
                // Someone planted this exact random name: draw another.
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(io::Error::other(
            "eight random temporary names were all taken: something is racing stallprof in this directory",
        ))
    }

    /// Write `name` whole through a buffered writer, fsynced and renamed
    /// into place, so an interrupted run never leaves half a file.
    pub fn write_with(
        &self,
        name: &str,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> io::Result<PathBuf> {
        let mut w = io::BufWriter::new(self.create(name)?);
        write(&mut w)?;
        w.into_inner().map_err(|e| e.into_error())?.persist()?;
        Ok(self.join(name))
    }

    pub fn write(&self, name: &str, bytes: &[u8]) -> io::Result<PathBuf> {
        self.write_with(name, |w| w.write_all(bytes))
    }

    /// A file that is `name` from the start and grows while stallprof runs
    /// (`record`'s journal): created like every other file under a random
    /// name (`O_EXCL | O_NOFOLLOW`), `head` written, then renamed into
    /// place at once and the directory fsynced, so a crash at any later
    /// point leaves it under its name. Returns it open for writing.
    pub fn create_growing(&self, name: &str, head: &[u8]) -> io::Result<File> {
        let mut p = self.create(name)?;
        p.write_all(head)?;
        let file = p.file.try_clone()?;
        p.persist()?;
        Ok(file)
    }

    /// Removes `name` (never following a symlink: unlinkat removes the
    /// entry itself).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        unlinkat(&*self.fd, name, AtFlags::empty())?;
        Ok(())
    }
}

/// A file being written under a random name in an [`OutDir`].
#[derive(Debug)]
pub struct PendingFile {
    file: File,
    dir: Arc<OwnedFd>,
    tmp: String,
    name: String,
    persisted: bool,
}

impl PendingFile {
    /// fsync, then rename onto the final name (replacing whatever entry is
    /// there, a symlink included, without following it), then fsync the
    /// directory so the new name survives a power cut too.
    pub fn persist(mut self) -> io::Result<()> {
        self.file.sync_all()?;
        renameat(
            &*self.dir,
            self.tmp.as_str(),
            &*self.dir,
            self.name.as_str(),
        )?;
        self.persisted = true;
        fsync(&*self.dir)?;
        Ok(())
    }
}

impl Write for PendingFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.persisted {
            let _ = unlinkat(&*self.dir, self.tmp.as_str(), AtFlags::empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        crate::os::scratch_dir(&format!("outdir-{name}"))
    }

    #[test]
    fn planted_symlink_is_replaced_not_followed() {
        let root = scratch("planted");
        let canary = root.join("canary");
        std::fs::write(&canary, b"canary").unwrap();
        let out = root.join("out");
        let dir = OutDir::create_new(&out).unwrap();
        symlink(&canary, out.join("stalls.json")).unwrap();
        dir.write("stalls.json", b"{}").unwrap();
        assert_eq!(std::fs::read(&canary).unwrap(), b"canary");
        assert_eq!(std::fs::read(out.join("stalls.json")).unwrap(), b"{}");
        let m = std::fs::symlink_metadata(out.join("stalls.json")).unwrap();
        assert!(m.is_file());
        assert_eq!(m.mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&out).unwrap().mode() & 0o777, 0o700);
        // No temporary file left behind.
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// `-o a/b/c`: missing parents are made 0700; a link of one's own (or
    /// root's) on the way is followed, another user's is refused and
    /// nothing is created where it points.
    #[test]
    fn parents_are_created_private_and_foreign_links_refused() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = scratch("parents");
        let deep = root.join("a/b/c");
        let out = OutDir::open_or_create(&deep).unwrap();
        out.write("f", b"x").unwrap();
        for d in ["a", "a/b", "a/b/c"] {
            let mode = std::fs::metadata(root.join(d)).unwrap().mode() & 0o777;
            assert_eq!(mode, 0o700, "{d}: {mode:o}");
        }
        // A relative path through a link of our own, with `..` in it.
        let real = root.join("real");
        std::fs::create_dir(&real).unwrap();
        symlink("real/../real", root.join("mine")).unwrap();
        OutDir::open_or_create(&root.join("mine/rec")).unwrap();
        assert!(real.join("rec").is_dir());

        if rustix::process::geteuid().as_raw() != 0 {
            panic!(
                "this test needs root (lchown of a planted link): run it under `cargo xtask test`"
            );
        }
        let shared = root.join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let victim = root.join("victim");
        std::fs::create_dir(&victim).unwrap();
        let planted = shared.join("out");
        symlink(&victim, &planted).unwrap();
        std::os::unix::fs::lchown(&planted, Some(65534), Some(65534)).unwrap();
        match OutDir::open_or_create(&planted.join("rec")) {
            Err(OutDirError::ForeignLink { owner: 65534, .. }) => {}
            other => panic!("followed another user's link: {other:?}"),
        }
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn refuses_symlinked_writable_and_existing_dirs() {
        let root = scratch("refuse");
        let real = root.join("real");
        std::fs::create_dir(&real).unwrap();
        symlink(&real, root.join("link")).unwrap();
        assert!(matches!(
            OutDir::open_or_create(&root.join("link")),
            Err(OutDirError::Symlink { .. })
        ));
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            OutDir::open_or_create(&real),
            Err(OutDirError::Writable { .. })
        ));
        assert!(matches!(
            OutDir::create_new(&real),
            Err(OutDirError::Exists { .. })
        ));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn reader_group_gets_0640_files_and_0750_dirs() {
        if rustix::process::geteuid().as_raw() != 0 {
            return; // chgrp to a group we are not in needs root
        }
        let root = scratch("group");
        let dir = OutDir::open_or_create_shared(&root, Some(65534)).unwrap();
        let sub = dir.subdir_new("w").unwrap().unwrap();
        assert!(
            dir.subdir_new("w").unwrap().is_none(),
            "a taken name is reported"
        );
        sub.write("stalls.json", b"{}").unwrap();
        let f = std::fs::metadata(root.join("w/stalls.json")).unwrap();
        assert_eq!((f.mode() & 0o777, f.gid()), (0o640, 65534));
        let d = std::fs::metadata(root.join("w")).unwrap();
        assert_eq!((d.mode() & 0o777, d.gid()), (0o750, 65534));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn dropped_pending_file_leaves_nothing() {
        let root = scratch("pending");
        let dir = OutDir::open_or_create(&root).unwrap();
        let mut f = dir.create("events.bin.gz").unwrap();
        f.write_all(b"x").unwrap();
        drop(f);
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
