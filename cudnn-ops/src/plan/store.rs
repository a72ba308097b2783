//! Persistent plans: what a finished plan leaves on disk (the finalized plan's JSON when cuDNN can
//! serialize its engine, and always the engine and knobs that autotuning chose), one file per plan
//! key in a plan directory, so that a new process loads what an earlier one built and tuned instead
//! of running heuristics, finalizing candidates and timing them again.
//!
//! This module is the part that needs no GPU: the directory, the file format, the atomic write, the
//! checks that reject a stale or damaged file, and the record of what happened (counters and events).
//! Turning a record into a plan (deserializing the JSON, or rebuilding the stored engine choice) is
//! in `lifecycle`.
//!
//! # File format (version [`FORMAT_VERSION`])
//!
//! Little-endian throughout; a string is a `u32` byte count and its UTF-8 bytes.
//!
//! | field | type |
//! |---|---|
//! | magic | 8 bytes, `CDNNPLAN` |
//! | format version | `u32` |
//! | body length | `u64`: bytes from here to the checksum |
//! | environment | GPU name (string), SM count (`u32`), compute capability (`u32`, `u32`), driver (`i64`), cuDNN (`u64`), crate version (string) |
//! | plan key | its type and `Debug` text (string) |
//! | graph | the graph's `Debug` text and the tuning it was built with (string) |
//! | engine | global index (`i64`), knob count (`u32`), then per knob its type (`u32`) and value (`i64`) |
//! | workspace | bytes (`u64`) |
//! | plan JSON | present (`u8`: 0 or 1), then the bytes cuDNN gave (`u32` count and bytes) |
//! | checksum | CRC-32 (IEEE 802.3, as zlib and PNG) of everything before it (`u32`) |
//!
//! The file name is the 64-bit FNV-1a hash of the key text, in hex, with `.plan`: the same key finds
//! the same file in every process and crate build, whatever the environment, so an entry left by
//! another driver or cuDNN is found, rejected as stale and replaced rather than piling up. The whole
//! key text is compared on load; a hash collision is a miss, not another key's plan.

use super::engine::EngineChoice;
use crate::disk::{self, crc32, fnv1a64, write_atomic, Reader, Refused, Writer};
use std::cell::{Cell, RefCell};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::sources::LOWERING_SOURCES;

/// The largest plan file read (a plan's JSON is tens of kilobytes; a larger file is not one of
/// ours).
const MAX_FILE_BYTES: u64 = 16 << 20;

/// This build as stored plans know it: the crate version and [`LOWERING_SOURCES`]' FNV-1a hash.
pub(crate) fn build_fingerprint() -> String {
    let mut h = Vec::new();
    for s in LOWERING_SOURCES {
        h.extend_from_slice(&fnv1a64(s.as_bytes()).to_le_bytes());
    }
    format!("{} lowering {:016x}", env!("CARGO_PKG_VERSION"), fnv1a64(&h))
}

/// Version of the file layout; a file of another version is stale. Bump it when the layout changes,
/// and when what a graph lowers to changes without its `Debug` text changing.
pub(crate) const FORMAT_VERSION: u32 = 1;

const MAGIC: [u8; 8] = *b"CDNNPLAN";

/// Bytes before the body: magic, format version, body length.
const PREFIX: usize = 8 + 4 + 8;

/// The subdirectory of the user's cache directory that holds plans.
const SUBDIR: [&str; 2] = ["cudnn-llm", "plans"];

/// Where plans go when asked for without a path: `$XDG_CACHE_HOME/cudnn-llm/plans`, else
/// `$HOME/.cache/cudnn-llm/plans` (`xdg` and `home` are those variables' values). A relative
/// `XDG_CACHE_HOME` is ignored, as the XDG base directory specification asks. `None` without either.
pub(crate) fn default_dir_from(xdg: Option<&OsStr>, home: Option<&OsStr>) -> Option<PathBuf> {
    let base = match xdg.map(Path::new).filter(|p| p.is_absolute()) {
        Some(xdg) => xdg.to_path_buf(),
        None => Path::new(home.filter(|h| !h.is_empty())?).join(".cache"),
    };
    Some(SUBDIR.iter().fold(base, |p, s| p.join(s)))
}

/// The plan directory a value of the environment variable asks for: unset, none (library default
/// off); empty, `off`, `0` or `none`: none; `on`, `1` or `default`: `default()`; anything else: that
/// path.
pub(crate) fn dir_from_setting(
    value: Option<&OsStr>,
    default: impl FnOnce() -> Option<PathBuf>,
) -> Option<PathBuf> {
    let value = value?;
    match value.to_str().map(str::trim) {
        Some("" | "off" | "0" | "none") => None,
        Some("on" | "1" | "default") => default(),
        _ => Some(PathBuf::from(value)),
    }
}

/// What a stored plan is valid for besides its key: the GPU, the driver, cuDNN and this crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Environment {
    /// GPU name, e.g. `NVIDIA H100 80GB HBM3`.
    pub(crate) gpu: String,
    /// Streaming multiprocessors (a MIG slice of a GPU has fewer under the same name).
    pub(crate) sm_count: u32,
    /// Compute capability (major, minor).
    pub(crate) compute_capability: (u32, u32),
    /// `cuDriverGetVersion()`.
    pub(crate) driver: i64,
    /// `cudnnGetVersion()` of the loaded library.
    pub(crate) cudnn: u64,
    /// This crate's version and a hash of the sources that lower graphs ([`build_fingerprint`]).
    pub(crate) crate_version: String,
}

impl Environment {
    /// The first field where `self` (the file's) differs from `here`, as `what: file vs here`.
    fn difference(&self, here: &Environment) -> Option<String> {
        let fields = [
            ("GPU", self.gpu.clone(), here.gpu.clone()),
            ("SM count", self.sm_count.to_string(), here.sm_count.to_string()),
            (
                "compute capability",
                format!("{}.{}", self.compute_capability.0, self.compute_capability.1),
                format!("{}.{}", here.compute_capability.0, here.compute_capability.1),
            ),
            ("driver", self.driver.to_string(), here.driver.to_string()),
            ("cuDNN", self.cudnn.to_string(), here.cudnn.to_string()),
            ("crate version", self.crate_version.clone(), here.crate_version.clone()),
        ];
        fields
            .into_iter()
            .find(|(_, a, b)| a != b)
            .map(|(what, a, b)| format!("{what}: {a} in the file, {b} here"))
    }
}

/// One stored plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) env: Environment,
    /// The plan key's type and `Debug` text.
    pub(crate) key: String,
    /// The graph's `Debug` text and tuning: a plan is only reused for the very graph it was built from.
    pub(crate) graph: String,
    /// The engine and knobs that run (autotuning's choice).
    pub(crate) engine: EngineChoice,
    /// Workspace bytes the plan needs.
    pub(crate) workspace: u64,
    /// `CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION` of the finalized plan; `None` where the engine
    /// could not be serialized (only the engine choice is stored then).
    pub(crate) json: Option<Vec<u8>>,
}

/// Why a file was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Unusable {
    /// Truncated, damaged or not a plan file.
    Corrupt(String),
    /// Written for another format version, GPU, driver, cuDNN or crate version.
    Stale(String),
}

impl Record {
    /// The file's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Writer::default();
        let e = &self.env;
        body.str(&e.gpu);
        body.u32(e.sm_count);
        body.u32(e.compute_capability.0);
        body.u32(e.compute_capability.1);
        body.i64(e.driver);
        body.u64(e.cudnn);
        body.str(&e.crate_version);
        body.str(&self.key);
        body.str(&self.graph);
        body.i64(self.engine.index);
        body.u32(self.engine.knobs.len() as u32);
        for &(kind, value) in &self.engine.knobs {
            body.u32(kind);
            body.i64(value);
        }
        body.u64(self.workspace);
        match &self.json {
            Some(json) => {
                body.0.push(1);
                body.bytes(json);
            }
            None => body.0.push(0),
        }
        let mut out = Writer(Vec::with_capacity(PREFIX + body.0.len() + 4));
        out.0.extend_from_slice(&MAGIC);
        out.u32(FORMAT_VERSION);
        out.u64(body.0.len() as u64);
        out.0.extend_from_slice(&body.0);
        let crc = crc32(&out.0);
        out.u32(crc);
        out.0
    }

    /// Parses a file's bytes, checking magic, version, length and checksum first.
    fn decode(bytes: &[u8]) -> Result<Record, Unusable> {
        let corrupt = |why: String| Unusable::Corrupt(why);
        if bytes.len() < PREFIX + 4 {
            if bytes.len() >= 8 && bytes[..8] != MAGIC {
                return Err(corrupt("not a plan file (bad magic)".into()));
            }
            return Err(corrupt(format!("truncated: {} bytes, shorter than any plan file", bytes.len())));
        }
        if bytes[..8] != MAGIC {
            return Err(corrupt("not a plan file (bad magic)".into()));
        }
        let mut r = Reader { bytes, at: 8 };
        let version = r.u32().map_err(corrupt)?;
        if version != FORMAT_VERSION {
            return Err(Unusable::Stale(format!(
                "format version {version}, this build reads {FORMAT_VERSION}"
            )));
        }
        let body = r.u64().map_err(corrupt)?;
        let expected = (PREFIX as u64).checked_add(body).and_then(|n| n.checked_add(4));
        if expected != Some(bytes.len() as u64) {
            return Err(corrupt(format!(
                "truncated or padded: {} bytes, the header says {}",
                bytes.len(),
                expected.map_or("more than fits".into(), |n| n.to_string())
            )));
        }
        let end = bytes.len() - 4;
        let stored = u32::from_le_bytes(bytes[end..].try_into().expect("4 bytes"));
        let computed = crc32(&bytes[..end]);
        if stored != computed {
            return Err(corrupt(format!(
                "checksum mismatch (CRC-32 {stored:08x} stored, {computed:08x} computed)"
            )));
        }
        let mut r = Reader { bytes: &bytes[..end], at: PREFIX };
        let record = (|| {
            let env = Environment {
                gpu: r.string()?,
                sm_count: r.u32()?,
                compute_capability: (r.u32()?, r.u32()?),
                driver: r.i64()?,
                cudnn: r.u64()?,
                crate_version: r.string()?,
            };
            let key = r.string()?;
            let graph = r.string()?;
            let index = r.i64()?;
            let knob_count = r.u32()? as usize;
            let mut knobs = Vec::with_capacity(knob_count.min(64));
            for _ in 0..knob_count {
                knobs.push((r.u32()?, r.i64()?));
            }
            let workspace = r.u64()?;
            let json = match r.take(1)?[0] {
                0 => None,
                1 => Some(r.bytes()?.to_vec()),
                other => return Err(format!("bad JSON flag {other}")),
            };
            if r.at != r.bytes.len() {
                return Err(format!("{} bytes left over after the last field", r.bytes.len() - r.at));
            }
            Ok(Record { env, key, graph, engine: EngineChoice { index, knobs }, workspace, json })
        })();
        record.map_err(|why| corrupt(format!("malformed body: {why}")))
    }
}

/// The file name of a key's plan.
pub(crate) fn file_name(key: &str) -> String {
    format!("{:016x}.plan", fnv1a64(key.as_bytes()))
}

/// What went wrong with a plan file (see [`PlanCache::disk_events`](crate::PlanCache::disk_events)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiskEventKind {
    /// Truncated, damaged (checksum) or not a plan file: rebuilt and replaced.
    Corrupt,
    /// Written for another format version, GPU, SM count, driver, cuDNN or crate version: rebuilt and
    /// replaced.
    Stale,
    /// Whole and current, but cuDNN refused it: the plan JSON did not finalize (then the stored
    /// engine choice is rebuilt instead), or neither did the engine choice (then the plan is built
    /// from scratch). Replaced either way.
    Unloadable,
    /// The plan could not be written (the plan itself works; the next process builds it again).
    WriteFailed,
    /// Not a file this user alone wrote: a symbolic link, a pipe or device, another user's file, one
    /// with group or world write permission, one over the size cap, or one in a directory other
    /// users own or may write (a directory made by `mkdir` under umask 002, mode 775, is one: make it
    /// 700, or let the library create it). Not loaded, since a plan file decides which kernels run on
    /// this process's buffers; rebuilt (and replaced by this user's where the directory is this
    /// user's; in another directory nothing is written, a `WriteFailed` event).
    Untrusted,
}

/// One problem with the plan directory, kept by the context's plan cache: the file, what happened,
/// why. None of these fails an op; each is reported once on stderr per context (the first), all are
/// kept here.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiskEvent {
    /// The plan file.
    pub path: PathBuf,
    /// What happened.
    pub kind: DiskEventKind,
    /// Why, in words.
    pub reason: String,
}

/// Counters and events of a cache's plan directory, shared with the slots of plans built from it.
#[derive(Debug, Default)]
pub(crate) struct DiskLog {
    pub(crate) hits: Cell<u64>,
    pub(crate) misses: Cell<u64>,
    pub(crate) rejects: Cell<u64>,
    pub(crate) writes: Cell<u64>,
    events: RefCell<Vec<DiskEvent>>,
    warned: Cell<bool>,
}

impl DiskLog {
    fn record(&self, path: &Path, kind: DiskEventKind, reason: String) {
        if !self.warned.replace(true) {
            let outcome = match kind {
                DiskEventKind::WriteFailed => "the plan runs but is not saved",
                _ => "the plan is rebuilt",
            };
            eprintln!(
                "cudnn-llm: plan file {}: {kind:?}: {reason} ({outcome}; further plan-file problems of this \
                 context are only recorded, see PlanCache::disk_events)",
                path.display()
            );
        }
        self.events.borrow_mut().push(DiskEvent { path: path.to_path_buf(), kind, reason });
    }

    pub(crate) fn events(&self) -> Vec<DiskEvent> {
        self.events.borrow().clone()
    }

    pub(crate) fn reset_counters(&self) {
        for c in [&self.hits, &self.misses, &self.rejects, &self.writes] {
            c.set(0);
        }
    }
}

/// A plan directory and the environment its plans must match.
#[derive(Debug, Clone)]
pub(crate) struct PlanStore {
    dir: PathBuf,
    env: Environment,
}

impl PlanStore {
    pub(crate) fn new(dir: PathBuf, env: Environment) -> Self {
        PlanStore { dir, env }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The slot of the key whose text is `key` (its type and `Debug` text).
    pub(crate) fn slot(&self, key: String, log: Rc<DiskLog>) -> Slot {
        Slot {
            dir: self.dir.clone(),
            name: file_name(&key),
            env: self.env.clone(),
            key,
            log,
            read: RefCell::new(None),
            hit: Cell::new(false),
            rejected: Cell::new(false),
        }
    }
}

/// What reading a slot's file gave.
#[derive(Debug)]
enum Read {
    /// No file, or one for another key (a hash collision).
    Missing,
    /// A file that could not be used (recorded as an event).
    Rejected,
    Found(Rc<Record>),
}

/// One key's file in the plan directory, for the duration of one plan cache miss and of the plan it
/// builds (until that plan is saved): read at most once, then counted as a hit, a miss or a
/// rejection.
#[derive(Debug)]
pub(crate) struct Slot {
    dir: PathBuf,
    name: String,
    env: Environment,
    key: String,
    log: Rc<DiskLog>,
    read: RefCell<Option<Read>>,
    hit: Cell<bool>,
    rejected: Cell<bool>,
}

impl Slot {
    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// The stored record for this key in this environment, if the file exists and passes every check
    /// (a file that fails one is recorded as rejected). Read once; later calls return the same.
    pub(crate) fn record(&self) -> Option<Rc<Record>> {
        if self.read.borrow().is_none() {
            let read = self.read_file();
            *self.read.borrow_mut() = Some(read);
        }
        match self.read.borrow().as_ref() {
            Some(Read::Found(r)) => Some(r.clone()),
            _ => None,
        }
    }

    fn read_file(&self) -> Read {
        let path = self.path();
        let read = disk::trusted_dir(&self.dir).and_then(|_| disk::read_own(&path, MAX_FILE_BYTES));
        let bytes = match read {
            Ok(Some(b)) => b,
            Ok(None) => return Read::Missing,
            Err(Refused::Untrusted(why)) => {
                self.reject(DiskEventKind::Untrusted, why);
                return Read::Rejected;
            }
            Err(Refused::Unreadable(why)) => {
                self.reject(DiskEventKind::Corrupt, why);
                return Read::Rejected;
            }
        };
        let record = match Record::decode(&bytes) {
            Ok(r) => r,
            Err(Unusable::Corrupt(why)) => {
                self.reject(DiskEventKind::Corrupt, why);
                return Read::Rejected;
            }
            Err(Unusable::Stale(why)) => {
                self.reject(DiskEventKind::Stale, why);
                return Read::Rejected;
            }
        };
        if let Some(why) = record.env.difference(&self.env) {
            self.reject(DiskEventKind::Stale, why);
            return Read::Rejected;
        }
        if record.key != self.key {
            return Read::Missing; // another key with the same file name: rebuilt and replaced
        }
        Read::Found(Rc::new(record))
    }

    /// Records that the file was not used, and why.
    pub(crate) fn reject(&self, kind: DiskEventKind, reason: String) {
        self.rejected.set(true);
        self.log.record(&self.path(), kind, reason);
    }

    /// Records that cuDNN refused part of the record but a plan was still made from it (an event, not
    /// a rejection).
    pub(crate) fn note(&self, kind: DiskEventKind, reason: String) {
        self.log.record(&self.path(), kind, reason);
    }

    /// Records that a plan came from the file.
    pub(crate) fn loaded(&self) {
        self.hit.set(true);
    }

    /// Counts this miss of the plan cache as a disk hit, rejection or miss (once, when the build
    /// closure returns).
    pub(crate) fn count(&self) {
        let counter = if self.hit.get() {
            &self.log.hits
        } else if self.rejected.get() {
            &self.log.rejects
        } else {
            &self.log.misses
        };
        counter.set(counter.get() + 1);
    }

    /// Stores the plan `graph` built and autotuning chose (the environment and key are the slot's).
    /// A failure is recorded as an event, never an error.
    pub(crate) fn save(&self, graph: String, engine: EngineChoice, workspace: u64, json: Option<Vec<u8>>) {
        let record = Record { env: self.env.clone(), key: self.key.clone(), graph, engine, workspace, json };
        match write_atomic(&self.dir, &self.name, &record.encode()) {
            Ok(()) => self.log.writes.set(self.log.writes.get() + 1),
            Err(e) => self.log.record(&self.path(), DiskEventKind::WriteFailed, e.to_string()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fresh directory under the system's temporary directory, removed on drop (tests never touch
    /// the user's cache directory).
    pub(crate) fn temp_dir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("cudnn-llm-test-{tag}-")).tempdir().unwrap()
    }

    pub(crate) fn env() -> Environment {
        Environment {
            gpu: "NVIDIA H100 80GB HBM3".into(),
            sm_count: 132,
            compute_capability: (9, 0),
            driver: 13000,
            cudnn: 91900,
            crate_version: "0.1.0".into(),
        }
    }

    fn record() -> Record {
        Record {
            env: env(),
            key: "cudnn_llm_ops::ops::rmsnorm::Key\nKey { tokens: 30, hidden: 2048 }".into(),
            graph: "Graph { name: \"rmsnorm\" }\nTuning { candidates: 1 }".into(),
            engine: EngineChoice { index: 7, knobs: vec![(24, 36), (17, -1)] },
            workspace: 4096,
            json: Some(b"{\"engineId\":7}\0".to_vec()),
        }
    }

    /// The reason of the only event of `log`, checked to be of `kind`.
    fn only_event(log: &DiskLog, kind: DiskEventKind) -> String {
        let events = log.events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].kind, kind, "{events:?}");
        events[0].reason.clone()
    }

    /// Every file of the crate that builds a cuDNN graph is part of the lowering hash, without a list
    /// to edit: a new room's graph (ragged SDPA's was once left out of a hand-kept list) changes the
    /// hash, so plans stored by an older build are not loaded for it. Likewise every `.cu` file is
    /// compiled. (Reads the sources where cargo built the crate; skipped where they are absent.)
    #[test]
    fn every_graph_building_file_and_every_kernel_is_covered() {
        use crate::sources::{KERNEL_FILES, LOWERING_FILES};
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        if !src.is_dir() {
            println!("SKIPPED: no sources at {}", src.display());
            return;
        }
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(&p, out)
                } else {
                    out.push(p)
                }
            }
        }
        let mut files = Vec::new();
        walk(&src, &mut files);
        let rel = |p: &Path| p.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        for p in &files {
            let r = rel(p);
            if r.ends_with(".rs") && std::fs::read_to_string(p).unwrap().contains("Graph::new(") {
                assert!(LOWERING_FILES.contains(&r.as_str()), "{r} builds a graph but is not hashed");
            }
            if r.ends_with(".cu") {
                assert!(KERNEL_FILES.contains(&r.as_str()), "{r} is not compiled");
            }
        }
        for room in
            ["ops/sdpa/ragged/fused.rs", "ops/matmul/fused.rs", "ops/rmsnorm/fused.rs", "graph/attention.rs"]
        {
            assert!(LOWERING_FILES.contains(&room), "{room}");
        }
        assert_eq!(KERNEL_FILES[0], "kernels/common.cu");
        assert_eq!(LOWERING_FILES.len(), LOWERING_SOURCES.len());
    }

    #[test]
    fn checksums_and_hashes_match_their_published_check_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(file_name("a"), "af63dc4c8601ec8c.plan");
    }

    #[test]
    fn a_record_round_trips_with_and_without_json() {
        let r = record();
        let bytes = r.encode();
        assert_eq!(&bytes[..8], b"CDNNPLAN");
        assert_eq!(Record::decode(&bytes), Ok(r.clone()));
        let bare = Record { json: None, engine: EngineChoice { index: 0, knobs: vec![] }, ..r };
        assert_eq!(Record::decode(&bare.encode()), Ok(bare));
    }

    #[test]
    fn every_truncation_is_corrupt() {
        let bytes = record().encode();
        for len in 0..bytes.len() {
            match Record::decode(&bytes[..len]) {
                Err(Unusable::Corrupt(_)) => {}
                other => panic!("{len} of {} bytes: {other:?}", bytes.len()),
            }
        }
        let mut padded = bytes.clone();
        padded.push(0);
        assert!(matches!(Record::decode(&padded), Err(Unusable::Corrupt(why)) if why.contains("padded")));
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        let bytes = record().encode();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x20;
            match Record::decode(&bad) {
                Err(Unusable::Corrupt(_)) => {}
                // The version field, flipped, reads as another format version.
                Err(Unusable::Stale(why)) if (8..12).contains(&i) => assert!(why.contains("format version")),
                other => panic!("byte {i} flipped: {other:?}"),
            }
        }
        let mut bad = bytes.clone();
        let mid = PREFIX + 10;
        bad[mid] ^= 1;
        assert!(matches!(Record::decode(&bad), Err(Unusable::Corrupt(why)) if why.contains("checksum")));
    }

    #[test]
    fn another_format_version_is_stale() {
        let mut bytes = record().encode();
        bytes[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        // Whatever follows, the version decides first (a later format may lay out the rest otherwise).
        let n = bytes.len();
        let crc = crc32(&bytes[..n - 4]);
        bytes[n - 4..].copy_from_slice(&crc.to_le_bytes());
        match Record::decode(&bytes) {
            Err(Unusable::Stale(why)) => {
                assert!(why.contains(&format!("format version {}", FORMAT_VERSION + 1)))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn files_of_another_environment_are_rejected_as_stale() {
        let dir = temp_dir("stale");
        type Change = (&'static str, fn(&mut Environment));
        let changes: [Change; 6] = [
            ("GPU", |e| e.gpu = "NVIDIA H200".into()),
            ("SM count", |e| e.sm_count = 66),
            ("compute capability", |e| e.compute_capability = (10, 0)),
            ("driver", |e| e.driver = 12080),
            ("cuDNN", |e| e.cudnn = 92000),
            ("crate version", |e| e.crate_version = "0.2.0".into()),
        ];
        for (what, change) in changes {
            let mut other = env();
            change(&mut other);
            let log = Rc::new(DiskLog::default());
            let key = record().key;
            PlanStore::new(dir.path().to_path_buf(), other).slot(key.clone(), log.clone()).save(
                "g".into(),
                EngineChoice { index: 1, knobs: vec![] },
                0,
                None,
            );
            let slot = PlanStore::new(dir.path().to_path_buf(), env()).slot(key, log.clone());
            assert!(slot.record().is_none(), "{what}");
            slot.count();
            assert_eq!((log.hits.get(), log.misses.get(), log.rejects.get()), (0, 0, 1), "{what}");
            let why = only_event(&log, DiskEventKind::Stale);
            assert!(why.starts_with(what), "{what}: {why}");
        }
    }

    #[test]
    fn a_slot_finds_what_a_slot_of_the_same_key_saved() {
        let dir = temp_dir("roundtrip");
        let store = PlanStore::new(dir.path().to_path_buf(), env());
        let log = Rc::new(DiskLog::default());
        let r = record();
        let first = store.slot(r.key.clone(), log.clone());
        assert!(first.record().is_none());
        first.count();
        first.save(r.graph.clone(), r.engine.clone(), r.workspace, r.json.clone());
        assert_eq!(log.writes.get(), 1);
        assert!(first.path().starts_with(dir.path()));
        let second = store.slot(r.key.clone(), log.clone());
        assert_eq!(second.record().as_deref(), Some(&r));
        second.loaded();
        second.count();
        // Another key: another file, a miss.
        let other = store.slot("another key".into(), log.clone());
        assert!(other.record().is_none());
        other.count();
        assert_eq!((log.hits.get(), log.misses.get(), log.rejects.get()), (1, 2, 0));
        assert!(log.events().is_empty(), "{:?}", log.events());
        // Only the finished file is left: the temporary one was renamed.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [file_name(&r.key)]);
    }

    #[test]
    fn damaged_files_are_rejected_as_corrupt_and_replaced_by_the_next_save() {
        let dir = temp_dir("corrupt");
        let store = PlanStore::new(dir.path().to_path_buf(), env());
        let r = record();
        let path = dir.path().join(file_name(&r.key));
        let whole = r.encode();
        let damages: [(&str, Vec<u8>); 4] = [
            ("truncated", whole[..whole.len() / 2].to_vec()),
            ("empty", Vec::new()),
            ("checksum", {
                let mut b = whole.clone();
                b[PREFIX + 3] ^= 0x40;
                b
            }),
            ("magic", b"not a plan file at all, but long enough to have a header".to_vec()),
        ];
        for (what, bytes) in damages {
            std::fs::write(&path, &bytes).unwrap();
            let log = Rc::new(DiskLog::default());
            let slot = store.slot(r.key.clone(), log.clone());
            assert!(slot.record().is_none(), "{what}");
            slot.count();
            assert_eq!(log.rejects.get(), 1, "{what}");
            let why = only_event(&log, DiskEventKind::Corrupt);
            println!("{what}: {why}");
            slot.save(r.graph.clone(), r.engine.clone(), r.workspace, r.json.clone());
            assert_eq!(store.slot(r.key.clone(), log).record().as_deref(), Some(&r), "{what}");
        }
    }

    /// A named pipe, a link to `/dev/zero` or an oversized file where a plan file belongs is an
    /// `Untrusted` event and a rebuild: never a hang, an unbounded read or a load.
    #[cfg(unix)]
    #[test]
    fn a_pipe_a_link_or_an_oversized_file_is_untrusted_and_replaced() {
        let dir = temp_dir("hostile");
        let store = PlanStore::new(dir.path().to_path_buf(), env());
        let r = record();
        let path = dir.path().join(file_name(&r.key));
        type Plant<'a> = (&'a str, &'a dyn Fn(&Path));
        let plant: [Plant; 3] = [
            ("fifo", &|p| {
                let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }),
            ("link to /dev/zero", &|p| std::os::unix::fs::symlink("/dev/zero", p).unwrap()),
            ("oversized", &|p| {
                use std::os::unix::fs::PermissionsExt;
                let f = std::fs::File::create(p).unwrap();
                f.set_len(MAX_FILE_BYTES + 1).unwrap();
                // Private whatever the umask, so that the size alone refuses it.
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
            }),
        ];
        let reasons = ["not a regular file", "symbolic link", "over the cap"];
        for ((what, plant), reason) in plant.into_iter().zip(reasons) {
            let _ = std::fs::remove_file(&path);
            plant(&path);
            let (tx, rx) = std::sync::mpsc::channel();
            let (store2, key) = (store.clone(), r.key.clone());
            std::thread::spawn(move || {
                let log = Rc::new(DiskLog::default());
                let got = store2.slot(key, log.clone()).record().is_some();
                tx.send((got, log.events())).unwrap();
            });
            let (loaded, events) = rx.recv_timeout(std::time::Duration::from_secs(10)).expect(what);
            assert!(!loaded, "{what}");
            assert_eq!(events.len(), 1, "{what}");
            assert_eq!(events[0].kind, DiskEventKind::Untrusted, "{what}");
            assert!(events[0].reason.contains(reason), "{what}: {}", events[0].reason);
            println!("{what}: {}", events[0].reason);
            // The next save replaces it with this user's regular file.
            let log = Rc::new(DiskLog::default());
            store.slot(r.key.clone(), log.clone()).save(
                r.graph.clone(),
                r.engine.clone(),
                r.workspace,
                r.json.clone(),
            );
            assert_eq!(store.slot(r.key.clone(), log).record().as_deref(), Some(&r), "{what}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn files_are_private_and_a_file_others_may_write_is_not_loaded() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("untrusted");
        let plans = dir.path().join("plans");
        let store = PlanStore::new(plans.clone(), env());
        let r = record();
        let log = Rc::new(DiskLog::default());
        store.slot(r.key.clone(), log.clone()).save(
            r.graph.clone(),
            r.engine.clone(),
            r.workspace,
            r.json.clone(),
        );
        let path = plans.join(file_name(&r.key));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&plans), mode(&path)), (0o700, 0o600));
        assert_eq!(store.slot(r.key.clone(), log.clone()).record().as_deref(), Some(&r));
        for loose in [0o620, 0o602] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(loose)).unwrap();
            let log = Rc::new(DiskLog::default());
            let slot = store.slot(r.key.clone(), log.clone());
            assert!(slot.record().is_none(), "mode {loose:o}");
            slot.count();
            println!("mode {loose:o}: {}", only_event(&log, DiskEventKind::Untrusted));
            // The next save replaces it with a private file, which loads.
            slot.save(r.graph.clone(), r.engine.clone(), r.workspace, r.json.clone());
            assert_eq!(mode(&path), 0o600);
            assert_eq!(store.slot(r.key.clone(), log).record().as_deref(), Some(&r), "mode {loose:o}");
        }
    }

    #[test]
    fn an_unwritable_directory_is_an_event_not_an_error() {
        let dir = temp_dir("unwritable");
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        // A directory below a regular file cannot be created.
        let store = PlanStore::new(file.join("plans"), env());
        let log = Rc::new(DiskLog::default());
        let slot = store.slot("k".into(), log.clone());
        slot.save("g".into(), EngineChoice { index: 1, knobs: vec![] }, 0, None);
        assert_eq!(log.writes.get(), 0);
        only_event(&log, DiskEventKind::WriteFailed);
    }

    /// Writers of one key in several threads (as processes sharing the directory would) while a
    /// reader reads: every read is a whole file of one writer, and the end leaves one whole file.
    #[test]
    fn concurrent_writers_of_one_key_leave_one_whole_file() {
        let dir = temp_dir("atomic");
        let key = record().key;
        let name = file_name(&key);
        let encoded: Vec<Vec<u8>> = (0..4)
            .map(|w| {
                Record { workspace: w, json: Some(vec![b'x'; 20_000 + w as usize * 7_000]), ..record() }
                    .encode()
            })
            .collect();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut reads = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(bytes) = std::fs::read(dir.path().join(&name)) {
                        assert!(encoded.contains(&bytes), "a partial or mixed file of {} bytes", bytes.len());
                        reads += 1;
                    }
                }
                reads
            });
            let writers: Vec<_> = encoded
                .iter()
                .map(|bytes| {
                    let (dir, name) = (dir.path(), &name);
                    s.spawn(move || {
                        for _ in 0..50 {
                            write_atomic(dir, name, bytes).unwrap();
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            println!("{} whole reads", reader.join().unwrap());
        });
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, std::slice::from_ref(&name), "temporary files left behind");
        let last = std::fs::read(dir.path().join(&name)).unwrap();
        assert!(encoded.contains(&last));
        assert!(Record::decode(&last).is_ok());
    }

    #[test]
    fn the_default_directory_follows_xdg_then_home() {
        let os = |s: &'static str| Some(OsStr::new(s));
        assert_eq!(
            default_dir_from(os("/x/cache"), os("/home/u")),
            Some(PathBuf::from("/x/cache/cudnn-llm/plans"))
        );
        assert_eq!(
            default_dir_from(None, os("/home/u")),
            Some(PathBuf::from("/home/u/.cache/cudnn-llm/plans"))
        );
        // A relative or empty XDG_CACHE_HOME is ignored.
        assert_eq!(
            default_dir_from(os("rel"), os("/home/u")),
            Some(PathBuf::from("/home/u/.cache/cudnn-llm/plans"))
        );
        assert_eq!(
            default_dir_from(os(""), os("/home/u")),
            Some(PathBuf::from("/home/u/.cache/cudnn-llm/plans"))
        );
        assert_eq!(default_dir_from(None, None), None);
        assert_eq!(default_dir_from(None, os("")), None);
    }

    #[test]
    fn the_setting_turns_plans_off_on_or_elsewhere() {
        let os = |s: &'static str| Some(OsStr::new(s));
        let default = || Some(PathBuf::from("/d"));
        assert_eq!(dir_from_setting(None, default), None, "unset: the library default, off");
        for off in ["", "off", "0", "none", " off "] {
            assert_eq!(dir_from_setting(os(off), default), None, "{off:?}");
        }
        for on in ["on", "1", "default"] {
            assert_eq!(dir_from_setting(os(on), default), Some(PathBuf::from("/d")), "{on:?}");
        }
        assert_eq!(dir_from_setting(os("on"), || None), None, "on, without a home: off");
        assert_eq!(dir_from_setting(os("/srv/plans"), default), Some(PathBuf::from("/srv/plans")));
        assert_eq!(dir_from_setting(os("rel/plans"), default), Some(PathBuf::from("rel/plans")));
    }
}
