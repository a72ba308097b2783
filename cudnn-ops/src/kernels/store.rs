//! Compiled kernels on disk: each room's CUBIN, kept in the `kernels/` folder of the plan directory
//! (see [`Cudnn::set_plan_dir`](crate::Cudnn::set_plan_dir)) under the trust rules of every cache of
//! this crate (`disk.rs`: a regular file of this user's, in a directory of this user's, under a size
//! cap), so that a new process loads what an earlier one compiled instead of running NVRTC again.
//!
//! A file is keyed by everything its CUBIN depends on: the room's name and the hash of its program's
//! text (`common.cu` and the room's file), the compile options (the GPU architecture among them),
//! NVRTC's version and the driver's.
//! The file name is the key's FNV-1a hash; the whole key is stored and compared on load, so a
//! collision or a file of another build is a miss, never a wrong kernel.
//!
//! # File format (version [`FORMAT_VERSION`])
//!
//! | field | type |
//! |---|---|
//! | magic | 8 bytes, `CDNNKERN` |
//! | format version | `u32` LE |
//! | key | `u32` LE byte count, UTF-8 |
//! | CUBIN | `u64` LE byte count, bytes |
//! | checksum | CRC-32 of everything before it (`u32` LE) |

use crate::disk::{self, crc32, fnv1a64, write_atomic, Reader, Writer};
use std::path::{Path, PathBuf};

const MAGIC: [u8; 8] = *b"CDNNKERN";

/// Version of the file layout; a file of another version is a miss.
const FORMAT_VERSION: u32 = 1;

/// The largest file read: a room's CUBIN is hundreds of kilobytes.
const MAX_FILE_BYTES: u64 = 64 << 20;

/// What a room's CUBIN was compiled from and for.
pub(crate) fn key(
    room: &str,
    program: &[&str],
    options: &[String],
    nvrtc: (i32, i32),
    driver: i32,
) -> String {
    let mut h = Vec::new();
    for text in program {
        h.extend_from_slice(&fnv1a64(text.as_bytes()).to_le_bytes());
    }
    format!(
        "room {room} source {:016x} options [{}] nvrtc {}.{} driver {driver} crate {}",
        fnv1a64(&h),
        options.join(" "),
        nvrtc.0,
        nvrtc.1,
        env!("CARGO_PKG_VERSION")
    )
}

/// The folder of the kernel cache in a plan directory.
pub(crate) fn dir_in(plan_dir: &Path) -> PathBuf {
    plan_dir.join("kernels")
}

fn file_name(key: &str) -> String {
    format!("{:016x}.cubin", fnv1a64(key.as_bytes()))
}

fn encode(key: &str, image: &[u8]) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(image.len() + key.len() + 32));
    w.raw(&MAGIC);
    w.u32(FORMAT_VERSION);
    w.str(key);
    w.u64(image.len() as u64);
    w.raw(image);
    let crc = crc32(&w.0);
    w.u32(crc);
    w.0
}

/// The CUBIN in `bytes` if they are a whole, undamaged file of this format for `key`; else why not.
fn decode(bytes: &[u8], key: &str) -> Result<Vec<u8>, String> {
    let body = bytes.len().checked_sub(4).ok_or("truncated")?;
    let stored = u32::from_le_bytes(bytes[body..].try_into().expect("4 bytes"));
    if crc32(&bytes[..body]) != stored {
        return Err("checksum mismatch (damaged or truncated)".into());
    }
    let mut r = Reader { bytes: &bytes[..body], at: 0 };
    let truncated = |_| "truncated".to_string();
    if r.take(8).map_err(truncated)? != MAGIC {
        return Err("not a kernel cache file".into());
    }
    let version = r.u32().map_err(truncated)?;
    if version != FORMAT_VERSION {
        return Err(format!("format version {version}, not {FORMAT_VERSION}"));
    }
    if r.bytes().map_err(truncated)? != key.as_bytes() {
        return Err("written for another source, GPU architecture, NVRTC or driver".into());
    }
    let ilen = usize::try_from(r.u64().map_err(truncated)?).map_err(|_| "too long")?;
    let image = r.take(ilen).map_err(truncated)?.to_vec();
    if r.at != body {
        return Err("trailing bytes".into());
    }
    Ok(image)
}

/// What the kernel cache had for a key.
#[derive(Debug, PartialEq)]
pub(crate) enum Lookup {
    /// The CUBIN compiled earlier for this key.
    Hit(Vec<u8>),
    /// No file.
    Miss,
    /// A file not used, and why (untrusted, unreadable, stale or damaged): compiled again and replaced
    /// where the directory is trusted.
    Unusable(String),
}

/// The CUBIN stored in `dir` for `key`.
pub(crate) fn load(dir: &Path, key: &str) -> Lookup {
    let path = dir.join(file_name(key));
    let read = disk::trusted_dir(dir).and_then(|trusted| match trusted {
        true => disk::read_own(&path, MAX_FILE_BYTES),
        false => Ok(None),
    });
    match read {
        Ok(None) => Lookup::Miss,
        Ok(Some(bytes)) => match decode(&bytes, key) {
            Ok(image) => Lookup::Hit(image),
            Err(why) => Lookup::Unusable(format!("{}: {why}", path.display())),
        },
        Err(refused) => Lookup::Unusable(format!("{}: {}", path.display(), refused.reason())),
    }
}

/// Stores `image` in `dir` for `key` (the directory created private if missing; an untrusted one is
/// not written).
pub(crate) fn save(dir: &Path, key: &str, image: &[u8]) -> std::io::Result<()> {
    write_atomic(dir, &file_name(key), &encode(key, image))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(major: i32, minor: i32) -> Vec<String> {
        vec![format!("--gpu-architecture=sm_{major}{minor}")]
    }

    fn dir() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("cudnn-llm-kernels").tempdir().unwrap()
    }

    #[test]
    fn a_saved_cubin_loads_back_under_its_key_only() {
        let d = dir();
        let kdir = dir_in(d.path());
        let k = key("ops/rmsnorm/naive.cu", &["common", "room"], &opts(9, 0), (13, 0), 13000);
        assert_eq!(load(&kdir, &k), Lookup::Miss);
        save(&kdir, &k, b"\x7fELF cubin bytes").unwrap();
        assert_eq!(load(&kdir, &k), Lookup::Hit(b"\x7fELF cubin bytes".to_vec()));
        // Every part of the key separates files: another source, architecture (options), NVRTC or
        // driver misses.
        for other in [
            key("ops/rmsnorm/naive.cu", &["common", "room2"], &opts(9, 0), (13, 0), 13000),
            key("ops/rmsnorm/naive.cu", &["common", "room"], &opts(8, 0), (13, 0), 13000),
            key("ops/rmsnorm/naive.cu", &["common", "room"], &opts(9, 0), (13, 1), 13000),
            key("ops/rmsnorm/naive.cu", &["common", "room"], &opts(9, 0), (13, 0), 13010),
            key("ops/sdpa/naive.cu", &["common", "room"], &opts(9, 0), (13, 0), 13000),
        ] {
            assert_ne!(other, k);
            assert_eq!(load(&kdir, &other), Lookup::Miss);
        }
        // A file renamed to another key's name is that key's miss, not its kernel.
        let other = key("ops/sdpa/naive.cu", &["common", "room"], &opts(9, 0), (13, 0), 13000);
        std::fs::copy(kdir.join(file_name(&k)), kdir.join(file_name(&other))).unwrap();
        assert!(matches!(load(&kdir, &other), Lookup::Unusable(why) if why.contains("another source")));
    }

    #[test]
    fn damaged_truncated_and_foreign_files_are_unusable() {
        let k = key("room", &["x"], &opts(9, 0), (13, 0), 13000);
        let good = encode(&k, &[1, 2, 3, 4, 5]);
        assert_eq!(decode(&good, &k).unwrap(), vec![1, 2, 3, 4, 5]);
        for n in 0..good.len() {
            assert!(decode(&good[..n], &k).is_err(), "truncated to {n}");
        }
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad, &k).is_err(), "byte {i} flipped");
        }
        // A well-formed file claiming a huge CUBIN is refused without allocating it.
        let mut huge = Vec::new();
        huge.extend_from_slice(&MAGIC);
        huge.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        huge.extend_from_slice(&(k.len() as u32).to_le_bytes());
        huge.extend_from_slice(k.as_bytes());
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        let crc = crc32(&huge);
        huge.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&huge, &k).unwrap_err(), "truncated");
    }

    #[cfg(unix)]
    #[test]
    fn a_cache_others_may_write_is_neither_read_nor_written() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir();
        let kdir = dir_in(d.path());
        let k = key("room", &["x"], &opts(9, 0), (13, 0), 13000);
        save(&kdir, &k, b"cubin").unwrap();
        std::fs::set_permissions(&kdir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(load(&kdir, &k), Lookup::Unusable(why) if why.contains("writable by other users")));
        assert!(save(&kdir, &k, b"other").is_err());
        std::fs::set_permissions(&kdir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let path = kdir.join(file_name(&k));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(load(&kdir, &k), Lookup::Unusable(why) if why.contains("writable by other users")));
    }
}
