//! Starts one process per rank on this host, the way `torchrun` does, for binaries that take ranks as
//! processes (`cudnn_llm::llama::nccl::rendezvous`):
//!
//! ```text
//! cudnn-llm-launch --nproc 2 -- generate --model DIR --prompt "..." --tp 2
//! cudnn-llm-launch --nnodes 2 --node-rank 0 --nproc 8 --master-addr node0 -- ...   # on each host
//! ```
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
//! (a free port of this host when one host runs the job and none is given) and `CUDNN_LLM_JOB` (a fresh
//! token on one host, `--job` across hosts), runs in its own process group and shares the launcher's
//! stdout and stderr. When a rank fails (a non-zero exit or a signal) the launcher says which (a rank
//! killed by a signal before one that exited with an error in the same moment), ends the others
//! (SIGTERM to their process groups, SIGKILL after `--grace` seconds) and exits with the failed rank's
//! code. SIGINT or SIGTERM to the launcher ends the ranks the same way. When the launcher is itself
//! killed, the ranks get SIGKILL from the kernel (a parent-death signal), so no rank outlives it.

use clap::Parser;
use cudnn_llm_app::bench_util::say;
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

/// One process per rank, started as torchrun starts them.
#[derive(Parser, Debug)]
#[command(name = "cudnn-llm-launch", version)]
struct Args {
    /// Ranks on this host (its GPUs).
    #[arg(long, value_name = "N")]
    nproc: usize,
    /// Hosts in the job.
    #[arg(long, default_value_t = 1, value_name = "M")]
    nnodes: usize,
    /// This host's index, 0..nnodes (its ranks are node_rank · nproc + 0..nproc).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Rank 0's host, as the others reach it (required with more than one host).
    #[arg(long)]
    master_addr: Option<String>,
    /// The port rank 0 listens on (one host: a free port when not given).
    #[arg(long)]
    master_port: Option<u16>,
    /// The job's token, the same on every host (ranks of another job are turned away by rank 0); one
    /// host: a fresh one when not given.
    #[arg(long)]
    job: Option<String>,
    /// Seconds the other ranks get to end after a rank failed, before SIGKILL.
    #[arg(long, default_value_t = 10.0)]
    grace: f64,
    /// The command each rank runs, and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// The most ranks one host starts.
const MAX_NPROC: usize = 1024;

fn main() -> ExitCode {
    let args = Args::parse();
    match plan(&args) {
        Ok(env) => {
            let job = match (&args.job, std::env::var("CUDNN_LLM_JOB")) {
                (Some(j), _) => j.clone(),
                (None, Ok(j)) => j,
                (None, Err(_)) if args.nnodes == 1 => fresh_token(),
                (None, Err(_)) => String::new(),
            };
            run(&args, env, &job)
        }
        Err(e) => {
            eprintln!("cudnn-llm-launch: {e}");
            ExitCode::from(2)
        }
    }
}

/// What every rank of this host shares: (world size, first rank here, master address, master port).
fn plan(a: &Args) -> Result<(usize, usize, String, u16), String> {
    if a.nproc == 0 || a.nproc > MAX_NPROC {
        return Err(format!("--nproc {}: give 1 to {MAX_NPROC} ranks", a.nproc));
    }
    if a.nnodes == 0 || a.node_rank >= a.nnodes {
        return Err(format!("--node-rank {} is not below --nnodes {}", a.node_rank, a.nnodes));
    }
    let world = a
        .nnodes
        .checked_mul(a.nproc)
        .filter(|&w| w <= cudnn_llm::llama::nccl::rendezvous::MAX_WORLD)
        .ok_or_else(|| format!("--nnodes {} x --nproc {} ranks is too many", a.nnodes, a.nproc))?;
    if !(a.grace.is_finite() && (0.0..=3600.0).contains(&a.grace)) {
        return Err(format!("--grace {}: give 0 to 3600 seconds", a.grace));
    }
    let addr = match (&a.master_addr, a.nnodes) {
        (Some(addr), _) if !addr.trim().is_empty() => addr.trim().to_string(),
        (Some(_), _) => return Err("--master-addr is empty".into()),
        (None, 1) => "127.0.0.1".into(),
        (None, _) => return Err("--master-addr: name rank 0's host (more than one host runs the job)".into()),
    };
    let port = match (a.master_port, a.nnodes) {
        (Some(0), _) => return Err("--master-port 0: give a port".into()),
        (Some(p), _) => p,
        (None, 1) => free_port().map_err(|e| format!("no free port on this host: {e}"))?,
        (None, _) => {
            return Err("--master-port: give the port rank 0 listens on (every host the same)".into())
        }
    };
    Ok((world, a.node_rank * a.nproc, addr, port))
}

/// A token no other launch is likely to have: this process's id and the time.
fn fresh_token() -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{:x}-{nanos:x}", std::process::id())
}

/// A port the system gives out now (free again when this returns; rank 0 binds it shortly after).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn run(a: &Args, (world, first, addr, port): (usize, usize, String, u16), job: &str) -> ExitCode {
    if job.len() > 256 {
        say("cudnn-llm-launch: --job: at most 256 bytes");
        return ExitCode::from(2);
    }
    forward_signals();
    let grace = Duration::from_secs_f64(a.grace);
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..a.nproc {
        let rank = first + local;
        let mut cmd = Command::new(&a.command[0]);
        cmd.args(&a.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
            .env("CUDNN_LLM_JOB", job);
        // SAFETY: between fork and exec the child makes only async-signal-safe calls (setpgid, prctl,
        // getppid, _exit): its own process group (so that ending a rank ends what it started), a
        // parent-death signal, and an exit if the launcher died before the signal was armed.
        unsafe {
            let parent = libc::getpid();
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                say(&format!("cudnn-llm-launch: rank {rank}: cannot start {}: {e}", a.command[0]));
                end(&mut children, grace);
                return ExitCode::from(1);
            }
        }
    }
    // Ranks are watched without being reaped (`exited`): a finished rank stays a zombie, its pid and
    // process group id taken, until `end` or the last rank; so a signal to its group never reaches
    // another process.
    loop {
        let signal = SIGNALLED.load(std::sync::atomic::Ordering::SeqCst);
        if signal != 0 {
            say(&format!("cudnn-llm-launch: signal {signal}: ending the ranks"));
            end(&mut children, grace);
            return ExitCode::from(u8::try_from(128 + signal).unwrap_or(1));
        }
        let states: Vec<(usize, Option<Exit>)> = children.iter().map(|(r, c)| (*r, exited(c))).collect();
        // A rank killed by a signal is the likelier cause when others failed in the same moment.
        let failed = states
            .iter()
            .filter_map(|(r, e)| e.filter(|e| !e.success()).map(|e| (*r, e)))
            .min_by_key(|(r, e)| (!matches!(e, Exit::Signal(_)), *r));
        if let Some((rank, exit)) = failed {
            say(&format!("cudnn-llm-launch: rank {rank} {}; ending the other ranks", exit.describe()));
            end(&mut children, grace);
            return ExitCode::from(exit.code());
        }
        if states.iter().all(|(_, e)| e.is_some()) {
            for (_, c) in children.iter_mut() {
                let _ = c.wait();
            }
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The signal SIGINT or SIGTERM delivered to the launcher (0: none yet).
static SIGNALLED: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn note_signal(signal: libc::c_int) {
    SIGNALLED.store(signal, std::sync::atomic::Ordering::SeqCst);
}

/// SIGINT and SIGTERM set [`SIGNALLED`] instead of ending the launcher, which then ends the ranks.
fn forward_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe); sigaction gets a zeroed,
        // then filled, struct that outlives the call.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = note_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// How a rank ended.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    fn success(self) -> bool {
        self == Exit::Code(0)
    }

    fn describe(self) -> String {
        match self {
            Exit::Code(c) => format!("exited with code {c}"),
            Exit::Signal(s) => format!("was killed by signal {s}"),
        }
    }

    /// The launcher's exit code for it: the rank's code, or 128 + its signal as a shell says.
    fn code(self) -> u8 {
        match self {
            Exit::Code(c) => u8::try_from(c).ok().filter(|&c| c != 0).unwrap_or(1),
            Exit::Signal(s) => u8::try_from(128 + s).unwrap_or(1),
        }
    }
}

/// How `child` ended, if it has, without reaping it (it stays a zombie until waited for).
fn exited(child: &Child) -> Option<Exit> {
    let pid = libc::id_t::from(child.id());
    // SAFETY: `info` is a zeroed siginfo the call fills; WNOWAIT leaves the child waitable.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        if libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) != 0 {
            return None;
        }
        if info.si_pid() == 0 {
            return None; // still running
        }
        Some(match info.si_code {
            libc::CLD_EXITED => Exit::Code(info.si_status()),
            _ => Exit::Signal(info.si_status()),
        })
    }
}

/// SIGTERM to every rank's process group (the rank and what it started), SIGKILL to the groups after
/// `grace` or once every rank ended (what they started and left behind); then reaps the ranks.
fn end(children: &mut [(usize, Child)], grace: Duration) {
    signal_groups(children, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        let running: Vec<usize> =
            children.iter().filter(|(_, c)| exited(c).is_none()).map(|(r, _)| *r).collect();
        if running.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            say(&format!("cudnn-llm-launch: rank(s) {running:?} still running after {grace:.0?}: SIGKILL"));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_groups(children, libc::SIGKILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
}

/// Sends `signal` to each rank's process group (its pid: each rank leads its own group).
fn signal_groups(children: &[(usize, Child)], signal: libc::c_int) {
    for (_, c) in children {
        let Ok(group) = libc::pid_t::try_from(c.id()) else { continue };
        // SAFETY: kill only sends a signal. No rank is reaped before this (they are watched with
        // WNOWAIT), so its pid, the group's id, belongs to the rank or its zombie and to no one else.
        unsafe { libc::kill(-group, signal) };
    }
}
