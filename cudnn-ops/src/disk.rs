//! Files this user wrote, and only those: the one way this crate reads and writes its on-disk caches
//! (the plan directory; any later cache follows the same rules).
//!
//! A cache file decides which GPU kernels run on a process's buffers, so it is read only when it is
//! what this user's own process would have written:
//!
//! - the directory is owned by this user and writable by no one else (it is created `0700`);
//! - the file is opened without following a symbolic link and without blocking (`O_NOFOLLOW |
//!   O_NONBLOCK`: a named pipe or a device never stalls the process), then checked on the open
//!   descriptor (`fstat`), so what is checked is what is read: a regular file, owned by this user,
//!   with no group or world write permission, no larger than the caller's cap;
//! - at most the cap is read, whatever the file grows to meanwhile.
//!
//! Anything else is a [`Refused`] answer with the reason in words (untrusted, or an ordinary I/O
//! failure); callers record it and rebuild, never hang, panic or load. Files are written to a temporary name and renamed into place
//! ([`write_atomic`]), readable and writable by this user only.

use std::io::{Read as _, Write as _};
use std::path::Path;

/// Why a file or directory is not read, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not this user's alone, or not a regular file (a link, a pipe, a device), or over the cap.
    Untrusted(String),
    /// An ordinary I/O failure (permissions, a disk error, too many open files).
    Unreadable(String),
}

impl Refused {
    /// The reason, in words.
    pub(crate) fn reason(&self) -> &str {
        match self {
            Refused::Untrusted(why) | Refused::Unreadable(why) => why,
        }
    }
}

use Refused::{Unreadable, Untrusted};

/// CRC-32 as in IEEE 802.3, zlib and PNG (reflected polynomial `0xEDB88320`, initial and final
/// value `0xFFFFFFFF`): `crc32(b"123456789") == 0xCBF43926`. Table-driven; plan files are small.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !bytes.iter().fold(!0u32, |c, &b| TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8))
}

/// 64-bit FNV-1a (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`), the stable hash that
/// names a key's file: `fnv1a64(b"") == 0xcbf29ce484222325`, `fnv1a64(b"a") == 0xaf63dc4c8601ec8c`.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Builds a cache file's bytes: little-endian integers, and byte strings as a `u32` count and the bytes.
#[derive(Default)]
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    pub(crate) fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    /// `b` as it is, no count before it.
    pub(crate) fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
}

/// Reads what a [`Writer`] built, every read checked against the end (an error in words past it).
pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!("{n} bytes asked at offset {} of {}", self.at, self.bytes.len()));
        };
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(crate) fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(crate) fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "a string is not UTF-8".to_string())
    }
}

/// The process's effective user id.
#[cfg(unix)]
fn this_user() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// `Some(why)` when `meta` (of a file or directory) is not this user's alone: another owner, or group
/// or world write permission.
#[cfg(unix)]
fn not_private(meta: &std::fs::Metadata) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let me = this_user();
    if meta.uid() != me {
        return Some(format!("owned by user {}, not by this user ({me})", meta.uid()));
    }
    (meta.mode() & 0o022 != 0).then(|| {
        format!("writable by other users (mode {:o}: group or world write permission)", meta.mode() & 0o777)
    })
}

/// Whether `dir` may hold files this process trusts: an existing directory owned by this user and
/// writable by no one else. `Ok(false)` when it does not exist.
pub(crate) fn trusted_dir(dir: &Path) -> Result<bool, Refused> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Unreadable(format!("directory {} cannot be read: {e}", dir.display()))),
    };
    if !meta.is_dir() {
        return Err(Untrusted(format!("{} is not a directory", dir.display())));
    }
    #[cfg(unix)]
    if let Some(why) = not_private(&meta) {
        return Err(Untrusted(format!("directory {} is {why}", dir.display())));
    }
    Ok(true)
}

/// The bytes of `path` if it is a file this user wrote (see the module docs), `Ok(None)` when there
/// is no such file. `cap` bounds its size in bytes.
pub(crate) fn read_own(path: &Path, cap: u64) -> Result<Option<Vec<u8>>, Refused> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut o, libc::O_NOFOLLOW | libc::O_NONBLOCK);
    let file = match o.open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        #[cfg(unix)]
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Untrusted("a symbolic link (only regular files are read)".into()))
        }
        Err(e) => return Err(Unreadable(format!("cannot be opened: {e}"))),
    };
    let meta = file.metadata().map_err(|e| Unreadable(format!("cannot be examined: {e}")))?;
    if !meta.is_file() {
        return Err(Untrusted(format!("not a regular file ({:?})", meta.file_type())));
    }
    #[cfg(unix)]
    if let Some(why) = not_private(&meta) {
        return Err(Untrusted(why));
    }
    if meta.len() > cap {
        return Err(Untrusted(format!("{} bytes, over the cap of {cap}", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(cap + 1).read_to_end(&mut bytes).map_err(|e| Unreadable(format!("cannot be read: {e}")))?;
    if bytes.len() as u64 > cap {
        return Err(Untrusted(format!("grew past the cap of {cap} bytes while read")));
    }
    Ok(Some(bytes))
}

/// Creates `dir` (and missing parents) readable and writable by this user only, on Unix.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
}

/// Creates `path` for writing, readable and writable by this user only, on Unix; never through a
/// symbolic link or onto an existing file.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
}

/// Writes `bytes` to `dir/name` so that no reader ever sees a partial file: into a temporary file
/// of the same directory (a name no other writer uses: the process id and a process-wide counter),
/// then renamed over `name`, which replaces a file atomically on POSIX file systems. Two writers of
/// one name both finish; the last rename wins, and either way the file is whole. There is no
/// fsync: after a crash a file may be short or empty, which its reader's checks must reject. A
/// directory this user does not own alone is not written to.
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    private_dir(dir)?;
    trusted_dir(dir)
        .map_err(|r| std::io::Error::new(std::io::ErrorKind::PermissionDenied, r.reason().to_string()))?;
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let written = private_file(&tmp)
        .and_then(|mut f| f.write_all(bytes))
        .and_then(|()| std::fs::rename(&tmp, dir.join(name)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("cudnn-llm-test-disk-").tempdir().unwrap()
    }

    fn refused(path: &Path) -> String {
        match read_own(path, 1 << 20) {
            Err(Untrusted(why)) => why,
            other => panic!("{} was not refused as untrusted: {other:?}", path.display()),
        }
    }

    #[test]
    fn a_file_this_user_wrote_reads_back_and_a_missing_one_is_none() {
        let d = dir();
        write_atomic(d.path(), "a", b"plan").unwrap();
        assert_eq!(read_own(&d.path().join("a"), 4).unwrap().as_deref(), Some(&b"plan"[..]));
        assert_eq!(read_own(&d.path().join("b"), 4).unwrap(), None);
        let mode = std::fs::metadata(d.path().join("a")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_named_pipe_is_refused_without_blocking() {
        let d = dir();
        let fifo = d.path().join("p");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Without O_NONBLOCK the open itself would wait for a writer forever.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(read_own(&fifo, 1 << 20)).unwrap());
        let got = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("reading a FIFO blocked");
        let why = got.unwrap_err();
        assert!(matches!(&why, Untrusted(w) if w.contains("not a regular file")), "{why:?}");
    }

    #[test]
    fn links_are_not_followed_even_to_this_users_own_file() {
        let d = dir();
        write_atomic(d.path(), "real", b"x").unwrap();
        for (name, target) in [("own", d.path().join("real")), ("zero", "/dev/zero".into())] {
            let link = d.path().join(name);
            std::os::unix::fs::symlink(&target, &link).unwrap();
            assert!(refused(&link).contains("symbolic link"), "{name}");
        }
    }

    #[test]
    fn a_file_others_may_write_or_over_the_cap_is_refused() {
        let d = dir();
        write_atomic(d.path(), "a", &[7; 100]).unwrap();
        let path = d.path().join("a");
        assert!(matches!(read_own(&path, 99), Err(Untrusted(w)) if w.contains("over the cap")));
        for loose in [0o620, 0o602] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(loose)).unwrap();
            assert!(refused(&path).contains("writable by other users"), "{loose:o}");
        }
    }

    #[test]
    fn a_file_or_directory_of_another_user_is_refused() {
        let d = dir();
        write_atomic(d.path(), "a", b"x").unwrap();
        let path = d.path().join("a");
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        if unsafe { libc::chown(c.as_ptr(), 4242, 4242) } != 0 {
            println!("SKIPPED: chown needs root ({})", std::io::Error::last_os_error());
            return;
        }
        assert!(refused(&path).contains("owned by user 4242"));
        let dc = std::ffi::CString::new(d.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::chown(dc.as_ptr(), 4242, 4242) }, 0);
        assert!(trusted_dir(d.path()).unwrap_err().reason().contains("owned by user 4242"));
        assert_eq!(
            write_atomic(d.path(), "b", b"x").unwrap_err().kind(),
            std::io::ErrorKind::PermissionDenied
        );
    }

    #[test]
    fn a_directory_others_may_write_is_refused_and_not_written() {
        let d = dir();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(trusted_dir(d.path()).unwrap_err().reason().contains("writable by other users"));
        assert!(write_atomic(d.path(), "a", b"x").is_err());
        assert!(!d.path().join("a").exists());
        assert_eq!(trusted_dir(&d.path().join("none")), Ok(false));
    }
}
