//! Ranks as processes: how one process per GPU finds the others and gets the NCCL unique id that makes
//! them one communicator, over TCP, with the environment `torchrun` sets (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), so that torchrun, `cudnn-llm-launch` or any launcher
//! setting them can start the ranks, on one host or many.
//!
//! Rank 0 listens on `MASTER_PORT`; every other rank connects to `MASTER_ADDR:MASTER_PORT` (retrying,
//! name lookup included, until rank 0 listens) and says who it is and which job it belongs to
//! (`CUDNN_LLM_JOB`, which `cudnn-llm-launch` sets to a fresh token, else torchrun's
//! `TORCHELASTIC_RUN_ID`); when all `WORLD_SIZE − 1` have, rank 0 sends each the payload (the unique
//! id). A connection that is not a rank of this job (another job's rank on a reused port, a port
//! scanner, a client that says nothing for [`GREETING`]) is closed and ignored; ranks of this job that
//! disagree (the world size, a rank claimed twice) end the rendezvous. Everything has a deadline: a rank
//! that never comes, or a rank 0 that cannot be reached, is an error naming the rank and the cause on
//! every rank that is up, not a hang.
//!
//! After the exchange the connections stay open as the ranks' lifelines ([`Session::watch`]): a rank
//! whose process ends without [`Session::finish`] (a crash, a kill) closes its connection, rank 0 sees
//! it at once and tells the others, and each rank's watcher calls its handler once with a message
//! naming the rank (the caller aborts its NCCL communicator there, so that no rank waits forever in a
//! collective for one that is gone). Heartbeats every [`HEARTBEAT`] also catch a host that vanishes
//! without closing anything, after [`Session::watch`]'s silence limit.
//!
//! # Wire format
//!
//! Hello (rank → rank 0): `CDNNRDZV`, version `u32`, rank `u32`, world size `u32`, job (`u32` byte
//! count, at most 256, and UTF-8). Payload (rank 0 → rank): `CDNNRDZV`, version `u32`, byte count
//! `u32`, bytes. Then messages both ways: a tag byte (`H` heartbeat, `B` goodbye, `A` abort followed by
//! a `u32` byte count and UTF-8 text), and `M` followed by a `u32` byte count and the bytes of a
//! [`Session::broadcast`] (from rank 0) or a [`Session::send`] (to rank 0). Integers are
//! little-endian.
//!
//! # Messages
//!
//! Once watching, rank 0 can [`Session::broadcast`] bytes to every other rank, which take them in order
//! with [`Session::receive`] (a leader's token stream: what the followers run next). A follower waiting
//! there learns of rank 0's clean end (`Ok(None)`) or of any rank's failure (an error naming it) as
//! its watchers do. The other way, each rank can [`Session::send`] bytes that rank 0 takes one of
//! every rank at a time with [`Session::gather`] (per-rank results for rank 0's report).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const MAGIC: [u8; 8] = *b"CDNNRDZV";
const VERSION: u32 = 2;
/// The most ranks a job may have (NCCL's own limits are far below).
pub const MAX_WORLD: usize = 1 << 16;
/// The largest payload exchanged (a unique id is 128 bytes).
const MAX_PAYLOAD: usize = 1 << 16;
/// The longest abort message read.
const MAX_MESSAGE: usize = 1 << 12;
/// The longest job token.
const MAX_JOB: usize = 256;
/// The longest wait anything here takes, whatever a timeout says.
const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// The largest [`Session::broadcast`] message (a prompt of a million token ids fits).
pub const MAX_MESSAGE_BYTES: usize = 1 << 26;
/// How often each rank tells the others it is alive.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// How long rank 0 waits for a connection's hello before closing it as a stranger.
pub const GREETING: Duration = Duration::from_secs(5);

/// Why a rank could not join, or lost, the others.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// The environment does not describe a rank: a variable missing or not a number, a rank past the
    /// world size.
    #[error("{0}")]
    Environment(String),
    /// The exchange failed: a rank missing at the deadline, rank 0 unreachable, ranks that disagree,
    /// an I/O error.
    #[error("rendezvous (rank {rank} of {world}): {why}")]
    Failed {
        /// This process's rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// What happened, naming the rank it concerns.
        why: String,
    },
}

/// The port rank 0's rendezvous listens on, when not `MASTER_PORT` (see [`RankEnv::master_port`]).
pub const PORT_ENV: &str = "CUDNN_LLM_RENDEZVOUS_PORT";

/// Where and who this rank is: the variables torchrun sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// `RANK`: this process's rank, `0..world`.
    pub rank: usize,
    /// `WORLD_SIZE`: how many ranks.
    pub world: usize,
    /// `LOCAL_RANK`: this process's rank on its host (its GPU), `RANK` when unset.
    pub local_rank: usize,
    /// `MASTER_ADDR`: rank 0's host.
    pub master_addr: String,
    /// The port rank 0 listens on: [`PORT_ENV`] if set, else `MASTER_PORT`, or the port after it
    /// under torchrun, whose agent serves its own store on `MASTER_PORT` (it sets
    /// `TORCHELASTIC_USE_AGENT_STORE=True`).
    pub master_port: u16,
    /// `CUDNN_LLM_JOB`, else `TORCHELASTIC_RUN_ID`, else empty: the job the ranks must share.
    pub job: String,
}

impl RankEnv {
    /// From the process's environment. `None` when `WORLD_SIZE` is unset (not launched as ranks); an
    /// error naming the variable when one is missing or not what it must be.
    pub fn from_env() -> Result<Option<RankEnv>, RendezvousError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`RankEnv::from_env`] when this process is one rank of several (`WORLD_SIZE` above 1), `None`
    /// when `WORLD_SIZE` is unset or 1 (a job of one process is no job of ranks: the other variables
    /// are not read). What the binaries use to choose their mode.
    pub fn of_several() -> Result<Option<RankEnv>, RendezvousError> {
        Self::of_several_from(|k| std::env::var(k).ok())
    }

    /// [`RankEnv::of_several`] with `var` as the environment.
    pub fn of_several_from(var: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>, RendezvousError> {
        match var("WORLD_SIZE") {
            Some(w) if w.trim() == "1" => Ok(None),
            _ => Self::from_vars(var),
        }
    }

    /// [`RankEnv::from_env`] with `var` as the environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>, RendezvousError> {
        let Some(world) = var("WORLD_SIZE") else { return Ok(None) };
        let num = |name: &str, v: &str, max: usize| -> Result<usize, RendezvousError> {
            v.trim().parse::<usize>().ok().filter(|&n| n <= max).ok_or_else(|| {
                RendezvousError::Environment(format!("{name}={v:?}: not a number up to {max}"))
            })
        };
        let need = |name: &str| {
            var(name).ok_or_else(|| {
                RendezvousError::Environment(format!(
                    "WORLD_SIZE is set but {name} is not (set by torchrun or cudnn-llm-launch)"
                ))
            })
        };
        let world = num("WORLD_SIZE", &world, MAX_WORLD)?;
        if world == 0 {
            return Err(RendezvousError::Environment("WORLD_SIZE=0: a job has at least one rank".into()));
        }
        let rank = num("RANK", &need("RANK")?, MAX_WORLD)?;
        if rank >= world {
            return Err(RendezvousError::Environment(format!("RANK={rank} is not below WORLD_SIZE={world}")));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", &v, MAX_WORLD)?,
            None => rank,
        };
        let master_addr = need("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(RendezvousError::Environment("MASTER_ADDR is empty".into()));
        }
        let port = need("MASTER_PORT")?;
        let master_port = num("MASTER_PORT", &port, u16::MAX as usize)? as u16;
        if master_port == 0 {
            return Err(RendezvousError::Environment(
                "MASTER_PORT=0: give the port rank 0 listens on".into(),
            ));
        }
        // torchrun's agent serves its own store on MASTER_PORT (and says so): ours takes the next
        // port, unless CUDNN_LLM_RENDEZVOUS_PORT names one.
        let master_port = match var(PORT_ENV) {
            Some(p) => match num(PORT_ENV, &p, u16::MAX as usize)? {
                0 => return Err(RendezvousError::Environment(format!("{PORT_ENV}=0: give a port"))),
                p => p as u16,
            },
            None if var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) => {
                master_port.checked_add(1).ok_or_else(|| {
                    RendezvousError::Environment(format!(
                        "MASTER_PORT={master_port} is torchrun's store and no port follows it: set {PORT_ENV}"
                    ))
                })?
            }
            None => master_port,
        };
        let job = var("CUDNN_LLM_JOB").or_else(|| var("TORCHELASTIC_RUN_ID")).unwrap_or_default();
        if job.len() > MAX_JOB {
            return Err(RendezvousError::Environment(format!("CUDNN_LLM_JOB: over {MAX_JOB} bytes")));
        }
        Ok(Some(RankEnv {
            rank,
            world,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
            job,
        }))
    }
}

/// Whether the session ended cleanly, and whether its failure was reported: checked and set under one
/// lock, so that a report never follows [`Session::finish`] and comes at most once.
#[derive(Default)]
struct Flags {
    done: bool,
    fired: bool,
}

/// A rank that joined the others: the payload rank 0 gave, and the open connections that watch the
/// other ranks' lives.
pub struct Session {
    rank: usize,
    world: usize,
    payload: Vec<u8>,
    /// Rank 0: one stream per other rank. Others: the stream to rank 0. Taken by [`Session::watch`].
    links: Vec<(usize, TcpStream)>,
    flags: Arc<Mutex<Flags>>,
    writers: Arc<Mutex<Vec<(usize, TcpStream)>>>,
    /// What the watchers hand on: taken by [`Session::watch`].
    inbox_sender: Option<mpsc::Sender<Inbound>>,
    inbox: Mutex<mpsc::Receiver<Inbound>>,
    /// Rank 0: each other rank's messages that came before the gather they belong to.
    early: Mutex<Vec<std::collections::VecDeque<Vec<u8>>>>,
}

/// What a watcher hands on: to a follower's [`Session::receive`] (from rank 0), or to rank 0's
/// [`Session::gather`] (from the rank it watches).
enum Inbound {
    /// A message: from rank 0 on a follower; on rank 0, from the rank named.
    Message(usize, Vec<u8>),
    /// Rank 0 said goodbye.
    Finished,
    /// A rank failed: why.
    Failed(String),
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

fn fail(rank: usize, world: usize, why: impl Into<String>) -> RendezvousError {
    RendezvousError::Failed { rank, world, why: why.into() }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn hello(rank: usize, world: usize, job: &str) -> Vec<u8> {
    let mut m = MAGIC.to_vec();
    m.extend_from_slice(&VERSION.to_le_bytes());
    m.extend_from_slice(&(rank as u32).to_le_bytes());
    m.extend_from_slice(&(world as u32).to_le_bytes());
    m.extend_from_slice(&(job.len() as u32).to_le_bytes());
    m.extend_from_slice(job.as_bytes());
    m
}

fn read_u32(s: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// A connection's hello: `Ok((rank, world))` from a rank of job `job`, `Err` (in words) from anything
/// else: a stranger, to be closed and ignored.
fn greeting(s: &mut TcpStream, job: &str, wait: Duration) -> Result<(usize, usize), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(wait.max(Duration::from_millis(50)))).map_err(|e| e.to_string())?;
    let mut m = [0u8; 8];
    s.read_exact(&mut m).map_err(|e| format!("no hello: {e}"))?;
    if m != MAGIC {
        return Err("not a cudnn-llm rank (wrong greeting)".into());
    }
    let v = read_u32(s).map_err(|e| e.to_string())?;
    if v != VERSION {
        return Err(format!("protocol version {v}, this build speaks {VERSION}"));
    }
    let rank = read_u32(s).map_err(|e| e.to_string())? as usize;
    let world = read_u32(s).map_err(|e| e.to_string())? as usize;
    let n = read_u32(s).map_err(|e| e.to_string())? as usize;
    if n > MAX_JOB {
        return Err(format!("a job token of {n} bytes"));
    }
    let mut theirs = vec![0u8; n];
    s.read_exact(&mut theirs).map_err(|e| e.to_string())?;
    if theirs != job.as_bytes() {
        return Err(format!("rank {rank} of another job ({:?})", String::from_utf8_lossy(&theirs)));
    }
    Ok((rank, world))
}

impl Session {
    /// Joins the job `env` describes: rank 0 listens on `MASTER_PORT` and sends every other rank
    /// `payload()` (called once, on rank 0 only, after all ranks said hello); the others connect and
    /// receive it. Fails after `timeout` naming who is missing. A job of one rank listens for no one.
    pub fn join(
        env: &RankEnv,
        timeout: Duration,
        payload: impl FnOnce() -> Result<Vec<u8>, String>,
    ) -> Result<Session, RendezvousError> {
        if env.world == 1 {
            let bytes = payload().map_err(|why| fail(0, 1, why))?;
            return Session::new(0, 1, bytes, Vec::new());
        }
        if env.rank == 0 {
            let listener = TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
                fail(0, env.world, format!("rank 0 cannot listen on port {}: {e}", env.master_port))
            })?;
            Self::serve(listener, env.world, &env.job, timeout, payload)
        } else {
            Self::connect(&env.master_addr, env.master_port, env.rank, env.world, &env.job, timeout)
        }
    }

    /// Rank 0's side on a bound `listener`, for the ranks of job `job`.
    pub fn serve(
        listener: TcpListener,
        world: usize,
        job: &str,
        timeout: Duration,
        payload: impl FnOnce() -> Result<Vec<u8>, String>,
    ) -> Result<Session, RendezvousError> {
        let deadline = deadline_after(timeout);
        let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        // Every failure from here tells the ranks that already joined, then returns the error.
        let give_up = |peers: &mut Vec<Option<TcpStream>>, why: String| {
            for s in peers.iter_mut().flatten() {
                let _ = send_abort(s, &why);
            }
            fail(0, world, why)
        };
        if let Err(e) = listener.set_nonblocking(true) {
            return Err(give_up(&mut peers, e.to_string()));
        }
        let mut strangers = 0usize;
        let mut last_stranger = String::new();
        while peers.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((mut s, from)) => {
                    let (rank, theirs) = match greeting(&mut s, job, remaining(deadline).min(GREETING)) {
                        Ok(hello) => hello,
                        Err(why) => {
                            strangers += 1;
                            last_stranger = format!("{why} (from {from})");
                            continue; // closed as `s` drops
                        }
                    };
                    let disagreement = if theirs != world {
                        Some(format!("rank {rank} says WORLD_SIZE={theirs}, rank 0 has {world}"))
                    } else if rank == 0 || rank >= world {
                        Some(format!("a rank says it is rank {rank} of {world}"))
                    } else if peers[rank - 1].is_some() {
                        Some(format!("two processes say they are rank {rank}"))
                    } else {
                        None
                    };
                    if let Some(why) = disagreement {
                        let why = format!("{why} (from {from})");
                        let _ = send_abort(&mut s, &why);
                        return Err(give_up(&mut peers, why));
                    }
                    // Messages are small and waited for: no batching of small writes.
                    let _ = s.set_nodelay(true);
                    peers[rank - 1] = Some(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = peers
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| p.is_none())
                            .map(|(i, _)| (i + 1).to_string())
                            .collect();
                        let mut why = format!(
                            "rank(s) {} did not join within {:.0?} (not started, or cannot reach MASTER_ADDR)",
                            missing.join(", "),
                            timeout
                        );
                        if strangers > 0 {
                            why += &format!(
                                "; {strangers} other connection(s) refused, the last: {last_stranger}"
                            );
                        }
                        return Err(give_up(&mut peers, why));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                // A connection that failed before it was accepted (reset, a protocol error): the next.
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        let bytes = match payload() {
            Ok(b) if b.len() <= MAX_PAYLOAD => b,
            Ok(b) => {
                return Err(give_up(
                    &mut peers,
                    format!("a payload of {} bytes is over {MAX_PAYLOAD}", b.len()),
                ))
            }
            Err(why) => return Err(give_up(&mut peers, format!("rank 0 failed: {why}"))),
        };
        let mut m = MAGIC.to_vec();
        m.extend_from_slice(&VERSION.to_le_bytes());
        m.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        m.extend_from_slice(&bytes);
        for i in 0..peers.len() {
            let sent = peers[i].as_mut().expect("every rank joined").write_all(&m);
            if let Err(e) = sent {
                peers[i] = None;
                return Err(give_up(&mut peers, format!("rank {} lost while sent the payload: {e}", i + 1)));
            }
        }
        let links =
            peers.into_iter().enumerate().map(|(i, s)| (i + 1, s.expect("every rank joined"))).collect();
        Session::new(0, world, bytes, links)
    }

    /// A non-zero rank's side: connects to `addr:port` (looking the name up and connecting again until
    /// `timeout`), says hello as rank `rank` of job `job` and receives the payload.
    pub fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        world: usize,
        job: &str,
        timeout: Duration,
    ) -> Result<Session, RendezvousError> {
        let deadline = deadline_after(timeout);
        let mut last = String::from("nothing tried");
        let mut s = loop {
            let targets: Vec<SocketAddr> = match (addr, port).to_socket_addrs() {
                Ok(t) => t.collect(),
                Err(e) => {
                    last = format!("name lookup: {e}");
                    Vec::new()
                }
            };
            let wait = remaining(deadline).clamp(Duration::from_millis(10), Duration::from_millis(500));
            let found = targets
                .iter()
                .find_map(|t| TcpStream::connect_timeout(t, wait).map_err(|e| last = e.to_string()).ok());
            match found {
                Some(s) => break s,
                None if Instant::now() >= deadline => {
                    return Err(fail(
                        rank,
                        world,
                        format!("cannot reach rank 0 at {addr}:{port} within {timeout:.0?}: {last}"),
                    ))
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let io = |e: std::io::Error| fail(rank, world, format!("talking to rank 0 at {addr}:{port}: {e}"));
        s.set_nodelay(true).map_err(io)?;
        s.write_all(&hello(rank, world, job)).map_err(io)?;
        s.set_read_timeout(Some(remaining(deadline).max(Duration::from_millis(100)))).map_err(io)?;
        let mut tag = [0u8; 1];
        s.read_exact(&mut tag)
            .map_err(|e| fail(rank, world, format!("rank 0 sent nothing within {timeout:.0?}: {e}")))?;
        if tag[0] == b'A' {
            // An abort instead of the payload: rank 0 says why.
            let text = read_text(&mut s).unwrap_or_else(|| "(unreadable)".into());
            return Err(fail(rank, world, format!("rank 0 gave up: {text}")));
        }
        let mut rest = [0u8; 7];
        s.read_exact(&mut rest).map_err(io)?;
        if tag[0] != MAGIC[0] || rest != MAGIC[1..] {
            return Err(fail(rank, world, format!("{addr}:{port} is not a cudnn-llm rank 0")));
        }
        let v = read_u32(&mut s).map_err(io)?;
        if v != VERSION {
            return Err(fail(
                rank,
                world,
                format!("rank 0 speaks protocol version {v}, this build {VERSION}"),
            ));
        }
        let n = read_u32(&mut s).map_err(io)? as usize;
        if n > MAX_PAYLOAD {
            return Err(fail(rank, world, format!("rank 0 sent a payload of {n} bytes, over {MAX_PAYLOAD}")));
        }
        let mut payload = vec![0u8; n];
        s.read_exact(&mut payload).map_err(io)?;
        Session::new(rank, world, payload, vec![(0, s)])
    }

    fn new(
        rank: usize,
        world: usize,
        payload: Vec<u8>,
        links: Vec<(usize, TcpStream)>,
    ) -> Result<Session, RendezvousError> {
        let writers = links
            .iter()
            .map(|(r, s)| s.try_clone().map(|s| (*r, s)))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| fail(rank, world, format!("cannot keep the connections: {e}")))?;
        let (inbox_sender, inbox) = mpsc::channel();
        Ok(Session {
            rank,
            world,
            payload,
            links,
            flags: Arc::new(Mutex::new(Flags::default())),
            writers: Arc::new(Mutex::new(writers)),
            inbox_sender: Some(inbox_sender),
            inbox: Mutex::new(inbox),
            early: Mutex::new(vec![Default::default(); world.saturating_sub(1)]),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// What rank 0 sent (on rank 0, what it sent).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Watches the other ranks from background threads: when one ends without [`Session::finish`]
    /// (its connection closes, it sends an abort, or it is silent for `silence`), `on_failure` is
    /// called once with a message naming the rank and the cause, and rank 0 passes the news to every
    /// other rank. Also starts this rank's heartbeats. Nothing is reported after [`Session::finish`]
    /// or [`Session::abort`].
    pub fn watch(&mut self, silence: Duration, on_failure: impl Fn(String) + Send + Sync + 'static) {
        let on_failure = Arc::new(on_failure);
        let inbox = self.inbox_sender.take();
        // A write to a host that vanished without a reset would block for the kernel's retransmits
        // (minutes) under the writers' lock, stopping every heartbeat: it gives up after `silence`.
        for (_, w) in lock(&self.writers).iter() {
            let _ = w.set_write_timeout(Some(silence.max(Duration::from_millis(100))));
        }
        for (peer, mut s) in std::mem::take(&mut self.links) {
            let (flags, writers, on_failure) = (self.flags.clone(), self.writers.clone(), on_failure.clone());
            let me = self.rank;
            // A follower's one link is to rank 0; rank 0 hears every other rank's messages.
            let inbox = inbox.clone();
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(silence));
                let hand_on = |what: Inbound| {
                    if let Some(inbox) = &inbox {
                        let _ = inbox.send(what);
                    }
                };
                let why = loop {
                    let mut tag = [0u8; 1];
                    match s.read_exact(&mut tag) {
                        Ok(()) if tag[0] == b'H' => continue,
                        Ok(()) if tag[0] == b'B' => {
                            if me != 0 {
                                hand_on(Inbound::Finished);
                            }
                            return;
                        }
                        Ok(()) if tag[0] == b'M' => match read_message(&mut s) {
                            Ok(bytes) => hand_on(Inbound::Message(peer, bytes)),
                            Err(why) => break format!("rank {peer} sent an unreadable message: {why}"),
                        },
                        Ok(()) if tag[0] == b'A' => {
                            break read_text(&mut s)
                                .unwrap_or_else(|| format!("rank {peer} sent an unreadable abort"))
                        }
                        Ok(()) => break format!("rank {peer} sent an unknown message"),
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            break format!(
                                "rank {peer} was silent for {silence:.0?} (its host is gone or hangs)"
                            )
                        }
                        Err(_) => {
                            break format!("rank {peer} closed its connection (it exited or was killed)")
                        }
                    }
                };
                {
                    let mut f = lock(&flags);
                    if f.done || f.fired {
                        return;
                    }
                    f.fired = true;
                }
                if me == 0 {
                    // Tell every other rank which one is gone.
                    for (r, w) in lock(&writers).iter_mut() {
                        if *r != peer {
                            let _ = send_abort(w, &why);
                        }
                    }
                }
                hand_on(Inbound::Failed(why.clone()));
                on_failure(why);
            });
        }
        let (flags, writers) = (self.flags.clone(), self.writers.clone());
        std::thread::spawn(move || loop {
            if lock(&flags).done {
                return;
            }
            lock(&writers).retain_mut(|(_, w)| w.write_all(b"H").is_ok());
            std::thread::sleep(HEARTBEAT);
        });
    }

    /// Rank 0: sends `bytes` to every other rank, which take them with [`Session::receive`] in the
    /// order sent. An error names a rank that could not be written to (it is gone; its watcher on
    /// rank 0 reports it too), or says this is not rank 0, or the message is over
    /// [`MAX_MESSAGE_BYTES`].
    pub fn broadcast(&self, bytes: &[u8]) -> Result<(), RendezvousError> {
        if self.rank != 0 {
            return Err(fail(self.rank, self.world, "only rank 0 broadcasts"));
        }
        let m = self.message(bytes)?;
        for (r, w) in lock(&self.writers).iter_mut() {
            w.write_all(&m)
                .map_err(|e| fail(0, self.world, format!("rank {r} cannot be sent a message: {e}")))?;
        }
        Ok(())
    }

    /// `bytes` framed as a message, or an error past [`MAX_MESSAGE_BYTES`].
    fn message(&self, bytes: &[u8]) -> Result<Vec<u8>, RendezvousError> {
        if bytes.len() > MAX_MESSAGE_BYTES {
            return Err(fail(
                self.rank,
                self.world,
                format!("a message of {} bytes is over {MAX_MESSAGE_BYTES}", bytes.len()),
            ));
        }
        let mut m = Vec::with_capacity(5 + bytes.len());
        m.push(b'M');
        m.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        m.extend_from_slice(bytes);
        Ok(m)
    }

    /// A non-zero rank: sends `bytes` to rank 0, which takes one message of every rank with
    /// [`Session::gather`]. Errors on rank 0, past [`MAX_MESSAGE_BYTES`], and when rank 0 cannot be
    /// written to.
    pub fn send(&self, bytes: &[u8]) -> Result<(), RendezvousError> {
        if self.rank == 0 {
            return Err(fail(0, self.world, "rank 0 gathers, it does not send to itself"));
        }
        let m = self.message(bytes)?;
        for (_, w) in lock(&self.writers).iter_mut() {
            w.write_all(&m)
                .map_err(|e| fail(self.rank, self.world, format!("rank 0 cannot be sent a message: {e}")))?;
        }
        Ok(())
    }

    /// Rank 0, after [`Session::watch`]: the next [`Session::send`] of every other rank, in rank
    /// order (`[rank 1's, rank 2's, ...]`), waited for up to `timeout` in all. A rank that failed, or
    /// one that sent nothing in time, is an error naming it.
    pub fn gather(&self, timeout: Duration) -> Result<Vec<Vec<u8>>, RendezvousError> {
        if self.rank != 0 {
            return Err(fail(self.rank, self.world, "only rank 0 gathers"));
        }
        if self.inbox_sender.is_some() {
            return Err(fail(0, self.world, "gather before watch: nothing reads the other ranks' links"));
        }
        let deadline = deadline_after(timeout);
        let inbox = lock(&self.inbox);
        let mut early = lock(&self.early);
        let mut got: Vec<Option<Vec<u8>>> = (1..self.world).map(|r| early[r - 1].pop_front()).collect();
        // On an error, what came stays first in line for the next gather.
        let keep = |got: &mut Vec<Option<Vec<u8>>>, early: &mut Vec<std::collections::VecDeque<Vec<u8>>>| {
            for (queue, m) in early.iter_mut().zip(got.drain(..)) {
                if let Some(m) = m {
                    queue.push_front(m);
                }
            }
        };
        while let Some(missing) = got.iter().position(Option::is_none) {
            match inbox.recv_timeout(remaining(deadline)) {
                Ok(Inbound::Message(peer, bytes)) if (1..self.world).contains(&peer) => {
                    match &got[peer - 1] {
                        None => got[peer - 1] = Some(bytes),
                        Some(_) => early[peer - 1].push_back(bytes), // its next gather's
                    }
                }
                Ok(Inbound::Message(..) | Inbound::Finished) => {}
                Ok(Inbound::Failed(why)) => {
                    keep(&mut got, &mut early);
                    return Err(fail(0, self.world, why));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    keep(&mut got, &mut early);
                    return Err(fail(
                        0,
                        self.world,
                        format!("rank {} sent nothing within {timeout:.0?}", missing + 1),
                    ));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    keep(&mut got, &mut early);
                    return Err(fail(0, self.world, "the other ranks' links are closed"));
                }
            }
        }
        Ok(got.into_iter().flatten().collect())
    }

    /// A non-zero rank, after [`Session::watch`]: rank 0's next [`Session::broadcast`], waited for up
    /// to `timeout`; `Ok(None)` once rank 0 finished ([`Session::finish`]). An error names a rank that
    /// failed (as the watchers report it), or says nothing came within `timeout`.
    pub fn receive(&self, timeout: Duration) -> Result<Option<Vec<u8>>, RendezvousError> {
        if self.rank == 0 {
            return Err(fail(0, self.world, "rank 0 sends messages, it does not receive them"));
        }
        if self.inbox_sender.is_some() {
            return Err(fail(self.rank, self.world, "receive before watch: nothing reads rank 0's link"));
        }
        let inbox = lock(&self.inbox);
        match inbox.recv_timeout(timeout.min(CENTURY)) {
            Ok(Inbound::Message(_, bytes)) => Ok(Some(bytes)),
            Ok(Inbound::Finished) => Ok(None),
            Ok(Inbound::Failed(why)) => Err(fail(self.rank, self.world, why)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(fail(self.rank, self.world, format!("nothing from rank 0 within {timeout:.0?}")))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(fail(self.rank, self.world, "rank 0's link is closed"))
            }
        }
    }

    /// Tells the other ranks this one fails with `why` (they see it as an abort naming this rank); this
    /// rank's watchers report nothing more (its own failure is the caller's to report).
    pub fn abort(&self, why: &str) {
        lock(&self.flags).fired = true;
        let text = format!("rank {} failed: {why}", self.rank);
        for (_, w) in lock(&self.writers).iter_mut() {
            let _ = send_abort(w, &text);
        }
    }

    /// Ends this rank's part cleanly: a goodbye to the others, so that its closing connection is no
    /// failure, and no more failures reported here.
    pub fn finish(self) {
        self.close(None);
    }

    /// Marks the session done (once) and says goodbye, or aborts with `abort`, to every other rank.
    fn close(&self, abort: Option<String>) {
        {
            let mut f = lock(&self.flags);
            if f.done {
                return;
            }
            f.done = true;
        }
        for (_, w) in lock(&self.writers).iter_mut() {
            let _ = match &abort {
                Some(text) => send_abort(w, text),
                None => w.write_all(b"B"),
            };
            let _ = w.shutdown(Shutdown::Both);
        }
        for (_, s) in &self.links {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// A session dropped without [`Session::finish`] (an error path of its process) tells the others so,
/// as an abort naming this rank, and closes its connections.
impl Drop for Session {
    fn drop(&mut self) {
        self.close(Some(format!("rank {} ended without finishing", self.rank)));
    }
}

fn send_abort(s: &mut TcpStream, why: &str) -> std::io::Result<()> {
    let text = &why.as_bytes()[..why.len().min(MAX_MESSAGE)];
    let mut m = vec![b'A'];
    m.extend_from_slice(&(text.len() as u32).to_le_bytes());
    m.extend_from_slice(text);
    s.write_all(&m)
}

/// A message's bytes, after its tag.
fn read_message(s: &mut impl Read) -> Result<Vec<u8>, String> {
    read_counted(s, MAX_MESSAGE_BYTES)
}

/// The text of an abort, after its tag.
fn read_text(s: &mut impl Read) -> Option<String> {
    read_counted(s, MAX_MESSAGE).ok().map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// A `u32` byte count of at most `max`, then that many bytes.
fn read_counted(s: &mut impl Read, max: usize) -> Result<Vec<u8>, String> {
    let n = read_u32(s).map_err(|e| e.to_string())? as usize;
    if n > max {
        return Err(format!("{n} bytes, over {max}"));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).map_err(|e| e.to_string())?;
    Ok(b)
}

/// The instant `timeout` from now, at most a century away (a longer timeout, `Duration::MAX`
/// included, waits a century rather than overflowing the clock).
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(CENTURY)).unwrap_or(now)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

#[cfg(test)]
mod tests {
    //! Fake ranks: threads of this process on loopback, rank 0 on a port the system picks.
    use super::*;
    use std::sync::mpsc;

    const T: Duration = Duration::from_secs(20);
    const JOB: &str = "job-1";

    fn listener() -> (TcpListener, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (l, port)
    }

    fn peer(
        port: u16,
        rank: usize,
        world: usize,
    ) -> std::thread::JoinHandle<Result<Session, RendezvousError>> {
        std::thread::spawn(move || Session::connect("127.0.0.1", port, rank, world, JOB, T))
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn a_job_of_one_process_is_no_job_of_ranks() {
        assert_eq!(RankEnv::of_several_from(vars(&[])).unwrap(), None);
        assert_eq!(
            RankEnv::of_several_from(vars(&[("WORLD_SIZE", "1")])).unwrap(),
            None,
            "nothing else read"
        );
        let two = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "29500")];
        assert_eq!(RankEnv::of_several_from(vars(&two)).unwrap().unwrap().rank, 1);
        assert!(RankEnv::of_several_from(vars(&[("WORLD_SIZE", "2")])).is_err(), "RANK missing");
    }

    #[test]
    fn under_torchrun_the_rendezvous_takes_the_port_after_its_store() {
        let base =
            [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        let port = |extra: &[(&str, &str)]| {
            let all: Vec<(&str, &str)> = base.iter().chain(extra).copied().collect();
            RankEnv::from_vars(vars(&all)).map(|e| e.unwrap().master_port)
        };
        assert_eq!(port(&[]).unwrap(), 29500);
        assert_eq!(port(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]).unwrap(), 29501);
        assert_eq!(port(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap(), 29500);
        assert_eq!(port(&[("TORCHELASTIC_USE_AGENT_STORE", "True"), (PORT_ENV, "40000")]).unwrap(), 40000);
        for bad in ["0", "65536", "x"] {
            assert!(port(&[(PORT_ENV, bad)]).unwrap_err().to_string().contains(PORT_ENV), "{bad}");
        }
        let top: Vec<(&str, &str)> = base[..3]
            .iter()
            .copied()
            .chain([("MASTER_PORT", "65535"), ("TORCHELASTIC_USE_AGENT_STORE", "True")])
            .collect();
        assert!(RankEnv::from_vars(vars(&top)).unwrap_err().to_string().contains("no port follows it"));
    }

    #[test]
    fn the_environment_torchrun_sets_is_read_and_checked() {
        let ok = [("RANK", "3"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")];
        let env = RankEnv::from_vars(vars(&ok)).unwrap().unwrap();
        assert_eq!(
            env,
            RankEnv {
                rank: 3,
                world: 4,
                local_rank: 3,
                master_addr: "node0".into(),
                master_port: 29500,
                job: String::new()
            }
        );
        let more = [&ok[..], &[("LOCAL_RANK", "1"), ("TORCHELASTIC_RUN_ID", "run7")]].concat();
        let env = RankEnv::from_vars(vars(&more)).unwrap().unwrap();
        assert_eq!((env.local_rank, env.job.as_str()), (1, "run7"));
        let ours = [&more[..], &[("CUDNN_LLM_JOB", "abc")]].concat();
        assert_eq!(RankEnv::from_vars(vars(&ours)).unwrap().unwrap().job, "abc");
        assert_eq!(RankEnv::from_vars(vars(&[])).unwrap(), None, "not launched as ranks");
        let long = "x".repeat(300);
        for (bad, says) in [
            (vec![("WORLD_SIZE", "4"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")], "RANK is not"),
            (
                vec![("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")],
                "not below",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "0"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")],
                "WORLD_SIZE=0",
            ),
            (
                vec![("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")],
                "RANK=\"x\"",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "99999999"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")],
                "WORLD_SIZE",
            ),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")], "MASTER_ADDR is not"),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", " "), ("MASTER_PORT", "1")],
                "MASTER_ADDR is empty",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "0")],
                "MASTER_PORT=0",
            ),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a")], "MASTER_PORT is not"),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "1"),
                    ("CUDNN_LLM_JOB", &long),
                ],
                "CUDNN_LLM_JOB",
            ),
        ] {
            let e = RankEnv::from_vars(vars(&bad)).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn four_ranks_get_rank_zeros_payload_whoever_starts_first() {
        // Two ranks start before rank 0 listens: they retry until it does.
        let (l, port) = listener();
        drop(l);
        let early = [peer(port, 1, 4), peer(port, 2, 4)];
        std::thread::sleep(Duration::from_millis(200));
        let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let zero = std::thread::spawn(move || Session::serve(l, 4, JOB, T, || Ok(b"unique id".to_vec())));
        let late = std::thread::spawn(move || Session::connect("localhost", port, 3, 4, JOB, T));
        let zero = zero.join().unwrap().unwrap();
        assert_eq!((zero.rank(), zero.world(), zero.payload()), (0, 4, &b"unique id"[..]));
        let mut ranks = Vec::new();
        for h in early.into_iter().chain([late]) {
            let s = h.join().unwrap().unwrap();
            assert_eq!((s.payload(), s.world()), (&b"unique id"[..], 4));
            ranks.push(s.rank());
            s.finish();
        }
        assert_eq!(ranks, [1, 2, 3]);
        zero.finish();
        // A job of one rank needs no one.
        let env = RankEnv {
            rank: 0,
            world: 1,
            local_rank: 0,
            master_addr: "x".into(),
            master_port: 1,
            job: "".into(),
        };
        assert_eq!(Session::join(&env, T, || Ok(vec![9])).unwrap().payload(), [9]);
    }

    #[test]
    fn any_timeout_is_taken_even_one_past_the_clock() {
        let (l, port) = listener();
        let one = std::thread::spawn(move || Session::connect("127.0.0.1", port, 1, 2, JOB, Duration::MAX));
        let zero = Session::serve(l, 2, JOB, Duration::MAX, || Ok(vec![3])).unwrap();
        assert_eq!(one.join().unwrap().unwrap().payload(), [3]);
        zero.finish();
    }

    #[test]
    fn a_rank_that_never_comes_is_named_on_every_rank_that_did() {
        let (l, port) = listener();
        let one = peer(port, 1, 3);
        let t = Instant::now();
        let e = Session::serve(l, 3, JOB, Duration::from_secs(3), || Ok(vec![1])).unwrap_err().to_string();
        assert!(e.contains("rank(s) 2 did not join"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        let e = one.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 0 gave up") && e.contains("rank(s) 2 did not join"), "{e}");
    }

    #[test]
    fn an_unreachable_rank_zero_is_an_error_after_the_timeout() {
        // Port 1 on loopback: nothing listens there.
        let t = Instant::now();
        let e =
            Session::connect("127.0.0.1", 1, 1, 2, JOB, Duration::from_millis(400)).unwrap_err().to_string();
        assert!(e.contains("cannot reach rank 0 at 127.0.0.1:1") && e.contains("rank 1 of 2"), "{e}");
        assert!(t.elapsed() >= Duration::from_millis(400) && t.elapsed() < Duration::from_secs(5));
        let e =
            Session::connect("no-such-host.invalid", 1, 1, 2, JOB, Duration::from_millis(300)).unwrap_err();
        assert!(e.to_string().contains("name lookup"), "{e}");
    }

    #[test]
    fn ranks_that_disagree_end_the_rendezvous() {
        for (rank, world, says) in [(1, 3, "says WORLD_SIZE=3"), (5, 2, "rank 5 of 2")] {
            let (l, port) = listener();
            let p = peer(port, rank, world);
            let e = Session::serve(l, 2, JOB, T, || Ok(vec![])).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
            assert!(p.join().unwrap().is_err());
        }
        let (l, port) = listener();
        let (a, b) = (peer(port, 1, 3), peer(port, 1, 3));
        let e = Session::serve(l, 3, JOB, T, || Ok(vec![])).unwrap_err().to_string();
        assert!(e.contains("two processes say they are rank 1"), "{e}");
        assert!(a.join().unwrap().is_err() && b.join().unwrap().is_err());
    }

    #[test]
    fn strangers_and_other_jobs_are_closed_and_ignored() {
        let (l, port) = listener();
        // Something else than a rank, a client that says nothing, and a rank of another job.
        let http = std::thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        });
        let other = std::thread::spawn(move || {
            Session::connect("127.0.0.1", port, 1, 2, "job-2", Duration::from_secs(2))
        });
        let one = peer(port, 1, 2);
        let zero = Session::serve(l, 2, JOB, T, || Ok(vec![5])).unwrap();
        assert_eq!(one.join().unwrap().unwrap().payload(), [5]);
        http.join().unwrap();
        assert!(other.join().unwrap().is_err(), "another job's rank gets nothing");
        zero.finish();
        // Only strangers: the timeout says so.
        let (l, port) = listener();
        let other = std::thread::spawn(move || {
            Session::connect("127.0.0.1", port, 1, 2, "job-2", Duration::from_secs(2))
        });
        let e = Session::serve(l, 2, JOB, Duration::from_secs(1), || Ok(vec![])).unwrap_err().to_string();
        assert!(e.contains("rank(s) 1 did not join") && e.contains("of another job (\"job-2\")"), "{e}");
        assert!(other.join().unwrap().is_err());
    }

    /// Three ranks; `kill` ends without `finish`, its sockets closed as when its process dies; every
    /// other rank's watcher reports it by name, promptly.
    fn a_dead_rank_is_reported_everywhere(kill: usize) {
        let (l, port) = listener();
        let peers = [peer(port, 1, 3), peer(port, 2, 3)];
        let mut sessions = vec![Session::serve(l, 3, JOB, T, || Ok(vec![7])).unwrap()];
        sessions.extend(peers.into_iter().map(|h| h.join().unwrap().unwrap()));
        let (tx, rx) = mpsc::channel();
        for s in sessions.iter_mut() {
            let (tx, me) = (tx.clone(), s.rank());
            if me != kill {
                s.watch(Duration::from_secs(30), move |why| tx.send((me, why)).unwrap());
            }
        }
        let t = Instant::now();
        let dead = sessions.remove(kill);
        for (_, s) in &dead.links {
            s.shutdown(Shutdown::Both).unwrap();
        }
        let mut heard: Vec<(usize, String)> =
            (0..2).map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
        heard.sort();
        assert!(t.elapsed() < Duration::from_secs(5));
        let expected: Vec<usize> = (0..3).filter(|&r| r != kill).collect();
        assert_eq!(heard.iter().map(|(r, _)| *r).collect::<Vec<_>>(), expected);
        for (r, why) in &heard {
            assert!(why.contains(&format!("rank {kill}")), "rank {r} heard {why:?}");
        }
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "one report per rank");
        drop(dead);
        for s in sessions {
            s.finish();
        }
    }

    #[test]
    fn a_peer_that_dies_is_reported_by_name_to_every_other_rank() {
        a_dead_rank_is_reported_everywhere(2);
    }

    #[test]
    fn a_rank_zero_that_dies_is_reported_to_every_other_rank() {
        a_dead_rank_is_reported_everywhere(0);
    }

    #[test]
    fn rank_0s_messages_reach_every_follower_in_order_then_its_goodbye() {
        let (l, port) = listener();
        let (one, two) = (peer(port, 1, 3), peer(port, 2, 3));
        let mut zero = Session::serve(l, 3, JOB, T, || Ok(vec![])).unwrap();
        let mut followers = vec![one.join().unwrap().unwrap(), two.join().unwrap().unwrap()];
        // Before watching nothing reads the link: an error, not a hang.
        let early = followers[0].receive(Duration::from_millis(10)).unwrap_err().to_string();
        assert!(early.contains("receive before watch"), "{early}");
        // No rank fails here: whatever a watcher reports ends in `failures`, checked at the end.
        let (report, failures) = mpsc::channel();
        let r = report.clone();
        zero.watch(T, move |why| r.send(why).unwrap());
        for f in &mut followers {
            let r = report.clone();
            f.watch(T, move |why| r.send(why).unwrap());
        }
        let big: Vec<u8> = (0..1_000_003u32).map(|i| (i % 251) as u8).collect();
        let sent = [b"prefill 1 2 3".to_vec(), Vec::new(), big];
        for m in &sent {
            zero.broadcast(m).unwrap();
        }
        let over = zero.broadcast(&vec![0; MAX_MESSAGE_BYTES + 1]).unwrap_err().to_string();
        assert!(over.contains("over"), "{over}");
        let not_zero = followers[1].broadcast(b"x").unwrap_err().to_string();
        assert!(not_zero.contains("only rank 0"), "{not_zero}");
        assert!(zero.receive(T).is_err(), "rank 0 receives nothing");
        for f in &followers {
            for m in &sent {
                assert_eq!(f.receive(T).unwrap().as_deref(), Some(&m[..]));
            }
            let quiet = f.receive(Duration::from_millis(50)).unwrap_err().to_string();
            assert!(quiet.contains("nothing from rank 0 within"), "{quiet}");
        }
        zero.finish();
        for f in &followers {
            assert_eq!(f.receive(T).unwrap(), None, "rank 0's goodbye");
        }
        for f in followers {
            f.finish();
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(failures.try_iter().collect::<Vec<_>>(), Vec::<String>::new());
    }

    #[test]
    fn rank_0_gathers_one_message_of_every_rank_in_rank_order() {
        let (l, port) = listener();
        let (one, two) = (peer(port, 1, 3), peer(port, 2, 3));
        let mut zero = Session::serve(l, 3, JOB, T, || Ok(vec![])).unwrap();
        let (mut one, mut two) = (one.join().unwrap().unwrap(), two.join().unwrap().unwrap());
        let early = zero.gather(T).unwrap_err().to_string();
        assert!(early.contains("gather before watch"), "{early}");
        zero.watch(T, |_| {});
        one.watch(T, |_| {});
        two.watch(T, |_| {});
        // Rank 2 sends twice before rank 1 sends at all: the second waits for the next gather.
        two.send(b"two-a").unwrap();
        two.send(b"two-b").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        one.send(b"one-a").unwrap();
        assert_eq!(zero.gather(T).unwrap(), [b"one-a".to_vec(), b"two-a".to_vec()]);
        one.send(b"").unwrap();
        assert_eq!(zero.gather(T).unwrap(), [Vec::new(), b"two-b".to_vec()]);
        let late = zero.gather(Duration::from_millis(50)).unwrap_err().to_string();
        assert!(late.contains("rank 1 sent nothing within"), "{late}");
        assert!(zero.send(b"x").unwrap_err().to_string().contains("does not send"));
        assert!(one.gather(T).unwrap_err().to_string().contains("only rank 0 gathers"));
        // A rank that dies while rank 0 gathers is named.
        one.send(b"one-c").unwrap();
        drop(two);
        let why = zero.gather(T).unwrap_err().to_string();
        assert!(why.contains("rank 2"), "{why}");
        one.finish();
    }

    #[test]
    fn a_follower_waiting_for_a_message_learns_which_rank_died() {
        let (l, port) = listener();
        let (one, two) = (peer(port, 1, 3), peer(port, 2, 3));
        let mut zero = Session::serve(l, 3, JOB, T, || Ok(vec![])).unwrap();
        let (mut one, two) = (one.join().unwrap().unwrap(), two.join().unwrap().unwrap());
        zero.watch(T, |_| {});
        one.watch(T, |_| {});
        let waiting = std::thread::spawn(move || one.receive(T).map(|_| ()).unwrap_err().to_string());
        std::thread::sleep(Duration::from_millis(50));
        drop(two); // rank 2's process ends without finishing
        let why = waiting.join().unwrap();
        assert!(why.contains("rank 2"), "{why}");
        drop(zero);
    }

    #[test]
    fn a_session_dropped_unfinished_aborts_naming_its_rank() {
        let (l, port) = listener();
        let one = peer(port, 1, 2);
        let mut zero = Session::serve(l, 2, JOB, T, || Ok(vec![])).unwrap();
        let one = one.join().unwrap().unwrap();
        let (tx, rx) = mpsc::channel();
        zero.watch(Duration::from_secs(30), move |why| tx.send(why).unwrap());
        drop(one);
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("rank 1 ended without finishing"), "{why}");
    }

    #[test]
    fn a_silent_rank_is_reported_and_a_clean_finish_is_no_failure() {
        let (l, port) = listener();
        let one = peer(port, 1, 2);
        let mut zero = Session::serve(l, 2, JOB, T, || Ok(vec![])).unwrap();
        let one = one.join().unwrap().unwrap();
        let (tx, rx) = mpsc::channel();
        // Rank 1 never starts its heartbeats (a host gone without closing its sockets).
        zero.watch(Duration::from_millis(300), move |why| tx.send(why).unwrap());
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("rank 1 was silent"), "{why}");
        drop(one);
        // Clean: both finish; nobody reports anything.
        let (l, port) = listener();
        let one = peer(port, 1, 2);
        let mut zero = Session::serve(l, 2, JOB, T, || Ok(vec![])).unwrap();
        let mut one = one.join().unwrap().unwrap();
        let (tx, rx) = mpsc::channel();
        let tx1 = tx.clone();
        zero.watch(Duration::from_secs(30), move |why| tx.send(why).unwrap());
        one.watch(Duration::from_secs(30), move |why| tx1.send(why).unwrap());
        std::thread::sleep(HEARTBEAT * 2);
        one.finish();
        zero.finish();
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
    }

    #[test]
    fn an_abort_names_the_rank_that_sent_it_and_silences_its_own_watchers() {
        let (l, port) = listener();
        let peers = [peer(port, 1, 3), peer(port, 2, 3)];
        let mut zero = Session::serve(l, 3, JOB, T, || Ok(vec![])).unwrap();
        let mut others: Vec<Session> = peers.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        let (tx, rx) = mpsc::channel();
        for (r, s) in [(0, &mut zero), (1, &mut others[0])] {
            let tx = tx.clone();
            s.watch(Duration::from_secs(30), move |why| tx.send((r, why)).unwrap());
        }
        let tx2 = tx.clone();
        others[1].watch(Duration::from_secs(30), move |why| tx2.send((2, why)).unwrap());
        others[0].abort("CUDA out of memory");
        let mut heard: Vec<(usize, String)> =
            (0..2).map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
        heard.sort();
        assert_eq!(heard.iter().map(|(r, _)| *r).collect::<Vec<_>>(), [0, 2]);
        for (r, why) in &heard {
            assert!(why.contains("rank 1 failed: CUDA out of memory"), "rank {r}: {why}");
        }
        // Rank 0 ends; the aborting rank's watcher stays quiet (its failure is its own to report).
        drop(zero);
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
        drop(tx);
        for s in others {
            s.finish();
        }
    }
}
