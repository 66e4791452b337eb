//! Who invoked stallprof, and the account a started command runs as.
//!
//! In: `SUDO_UID`/`SUDO_GID` (set by sudo), a `--user` name, the password
//! and group databases (through libc's getpwnam_r/getpwuid_r/getgrouplist).
//! Out: a [`User`] (or a group id) with everything a child needs to drop to it, gathered
//! before fork (nothing of this may run between fork and exec).
use std::ffi::{CStr, CString};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum UserError {
    #[error("no user named {0:?} in the password database: give an existing user with --user")]
    NoSuchUser(String),
    #[error("no group named {0:?}: give an existing group (see `getent group`)")]
    NoSuchGroup(String),
    #[error("reading the password database for {what}: {source}")]
    Lookup {
        what: String,
        source: std::io::Error,
    },
}

/// An account to run a command as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    /// The login name, when the password database has one.
    pub name: Option<String>,
    pub home: Option<String>,
    /// Supplementary groups (getgrouplist: what initgroups would set).
    pub groups: Vec<u32>,
}

/// The user who ran `sudo stallprof …`: from `SUDO_UID`/`SUDO_GID`, only
/// when running as root and the invoker is not root.
pub fn sudo_invoker() -> Option<User> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let uid: u32 = std::env::var("SUDO_UID").ok()?.trim().parse().ok()?;
    if uid == 0 {
        return None;
    }
    let gid: Option<u32> = std::env::var("SUDO_GID")
        .ok()
        .and_then(|g| g.trim().parse().ok());
    let mut user = by_uid(uid).ok().flatten().unwrap_or(User {
        uid,
        gid: gid.unwrap_or(uid),
        name: None,
        home: None,
        groups: Vec::new(),
    });
    if let Some(g) = gid {
        user.gid = g;
    }
    if user.groups.is_empty() {
        user.groups.push(user.gid);
    }
    Some(user)
}

/// `--user NAME` (or a numeric uid).
pub fn by_name(name: &str) -> Result<User, UserError> {
    if let Ok(uid) = name.parse::<u32>() {
        return Ok(by_uid(uid)?.unwrap_or(User {
            uid,
            gid: uid,
            name: None,
            home: None,
            groups: vec![uid],
        }));
    }
    let c = CString::new(name).map_err(|_| UserError::NoSuchUser(name.into()))?;
    lookup(
        |pw, buf, res| unsafe {
            // SAFETY: every pointer is to a live buffer of the stated length.
            libc::getpwnam_r(c.as_ptr(), pw, buf.as_mut_ptr(), buf.len(), res)
        },
        name,
    )?
    .ok_or_else(|| UserError::NoSuchUser(name.into()))
}

fn by_uid(uid: u32) -> Result<Option<User>, UserError> {
    lookup(
        |pw, buf, res| unsafe {
            // SAFETY: as in by_name.
            libc::getpwuid_r(uid, pw, buf.as_mut_ptr(), buf.len(), res)
        },
        &format!("uid {uid}"),
    )
}

fn lookup(
    call: impl Fn(*mut libc::passwd, &mut Vec<libc::c_char>, *mut *mut libc::passwd) -> libc::c_int,
    what: &str,
) -> Result<Option<User>, UserError> {
    let mut buf: Vec<libc::c_char> = vec![0; 4096];
    loop {
        // SAFETY: passwd is plain data; getpw*_r fills it.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut res: *mut libc::passwd = std::ptr::null_mut();
        let rc = call(&mut pw, &mut buf, &mut res);
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 {
            return Err(UserError::Lookup {
                what: what.into(),
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        if res.is_null() {
            return Ok(None);
        }
        // SAFETY: on success pw's strings point into buf, NUL-terminated.
        let (name, home) = unsafe {
            (
                CStr::from_ptr(pw.pw_name).to_owned(),
                (!pw.pw_dir.is_null()).then(|| CStr::from_ptr(pw.pw_dir).to_owned()),
            )
        };
        let groups = group_list(&name, pw.pw_gid);
        return Ok(Some(User {
            uid: pw.pw_uid,
            gid: pw.pw_gid,
            name: Some(name.to_string_lossy().into_owned()),
            home: home.map(|h| h.to_string_lossy().into_owned()),
            groups,
        }));
    }
}

fn group_list(name: &CStr, gid: u32) -> Vec<u32> {
    let mut n: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let mut count = n;
        // SAFETY: groups holds `count` entries; getgrouplist writes at most
        // that many and sets `count` to the total.
        let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            groups.truncate(count as usize);
            return groups;
        }
        if count <= n || n > 65536 {
            return vec![gid];
        }
        n = count;
    }
}

/// A group's id from its name (or a numeric gid).
pub fn group_id(name: &str) -> Result<u32, UserError> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let c = CString::new(name).map_err(|_| UserError::NoSuchGroup(name.into()))?;
    let mut buf: Vec<libc::c_char> = vec![0; 4096];
    loop {
        // SAFETY: group is plain data; getgrnam_r fills it, its strings
        // pointing into buf, which outlives the read of gr_gid below.
        let mut gr: libc::group = unsafe { std::mem::zeroed() };
        let mut res: *mut libc::group = std::ptr::null_mut();
        let rc =
            unsafe { libc::getgrnam_r(c.as_ptr(), &mut gr, buf.as_mut_ptr(), buf.len(), &mut res) };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 {
            return Err(UserError::Lookup {
                what: format!("group {name}"),
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        if res.is_null() {
            return Err(UserError::NoSuchGroup(name.into()));
        }
        return Ok(gr.gr_gid);
    }
}
